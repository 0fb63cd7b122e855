//! Building [`Settings`] from the file, the environment and the command line
//! (DESIGN.md §15).
//!
//! Layers, lowest to highest precedence:
//!
//! 1. defaults ([`Settings::default`]);
//! 2. the TOML file given with `--config`;
//! 3. environment variables `FLEETMQ_SECTION__KEY=value`, e.g.
//!    `FLEETMQ_LIMITS__MAX_PACKET_SIZE=2MiB` (section and key are joined by a
//!    double underscore and lower-cased; variables starting `FLEETMQ_` without
//!    `__` are not settings and are ignored, except one that reads as a
//!    setting with a single underscore, `FLEETMQ_LIMITS_MAX_CLIENTS`, which
//!    stops the start naming the right spelling);
//! 4. `--set section.key=value`, repeatable, later ones winning;
//! 5. the flags `--listen` (repeatable; replaces `listeners.tcp` when given),
//!    `--admin` and `--shards`.
//!
//! Layers are merged into one TOML table and deserialized once, so an unknown
//! key or a bad value is reported with its dotted key wherever it came from.
//! A value from the environment or `--set` is read as a TOML literal when it
//! is one (`true`, `5`, `["a", "b"]`, `"quoted"`), else as a plain string
//! (`10s`, `1MiB`, `0.0.0.0:1883`).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use fleetmq_core::settings::{toml_key, Settings, SettingsError, TOO_LARGE};
use toml::{Table, Value};

/// Prefix of environment variables that hold settings.
pub const ENV_PREFIX: &str = "FLEETMQ_";

/// The flags shared by `fleetmq serve` and `fleetmq check-config`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file: the sections and keys `fleetmq check-config`
    /// prints, each optional.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Set one setting, e.g. `--set limits.max_packet_size=2MiB`; wins over
    /// the file and the environment. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// MQTT TCP listener address; replaces `listeners.tcp` when given.
    /// Repeatable.
    #[arg(long, value_name = "IP:PORT")]
    pub listen: Vec<String>,
    /// Admin HTTP address (`admin.listen`); "" disables the admin server.
    #[arg(long, value_name = "IP:PORT")]
    pub admin: Option<String>,
    /// Number of shards (`server.shards`); 0 means one per core.
    #[arg(long, value_name = "N")]
    pub shards: Option<usize>,
}

/// Builds and validates the effective settings from `args`, the process
/// environment and the file `args.config` names.
///
/// # Errors
///
/// The file cannot be read or is not TOML; a `--set` or environment entry is
/// malformed; a key is unknown or a value has the wrong type or unit (the
/// error names the dotted key); or [`Settings::validate`] refuses the result.
pub fn load(args: &ServeArgs) -> anyhow::Result<Settings> {
    load_from(args, settings_env(std::env::vars_os())?)
}

/// The `FLEETMQ_*` entries of `vars` (the process environment) as text.
/// Other entries are not fleetmq's and are skipped whatever their bytes:
/// one variable in Latin-1 elsewhere in the environment must not stop the
/// start (`std::env::vars` panics on it).
///
/// # Errors
///
/// A `FLEETMQ_*` variable whose name or value is not UTF-8, named (with
/// its bytes escaped).
pub fn settings_env(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    for (name, value) in vars {
        if !name.as_encoded_bytes().starts_with(ENV_PREFIX.as_bytes()) {
            continue;
        }
        match (name.into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => env.push((name, value)),
            (Ok(name), Err(_)) => bail!("environment variable {name}: the value is not valid UTF-8"),
            (Err(name), _) => bail!("environment variable {name:?}: the name is not valid UTF-8"),
        }
    }
    Ok(env)
}

/// [`load`] with the environment given explicitly, for tests and embedding.
///
/// # Errors
///
/// As [`load`].
pub fn load_from(
    args: &ServeArgs,
    env: impl IntoIterator<Item = (String, String)>,
) -> anyhow::Result<Settings> {
    let mut table = match &args.config {
        Some(path) => read_file(path)?,
        None => Table::new(),
    };
    let mut env: Vec<(String, String)> = env
        .into_iter()
        .filter(|(name, _)| name.starts_with(ENV_PREFIX))
        .collect();
    if let Some((name, key)) = env.iter().find_map(|(name, _)| Some((name, one_underscore_key(name)?))) {
        let spelled = format!("{ENV_PREFIX}{}", key.replacen('.', "__", 1).to_ascii_uppercase());
        bail!(
            "environment variable {name} looks like the setting {key} with one underscore \
             after the section; settings are spelled {spelled}"
        );
    }
    env.retain(|(name, _)| name.contains("__"));
    // Deterministic order, so that two spellings of one key resolve the same
    // way every time.
    env.sort();
    for (name, value) in env {
        let key = env_key(&name)?;
        set_path(&mut table, &key, literal(&value))
            .with_context(|| format!("environment variable {name}"))?;
    }
    for entry in &args.set {
        let (key, value) = entry.split_once('=').ok_or_else(|| {
            anyhow!("--set {entry:?}: expected KEY=VALUE, e.g. limits.max_clients=1000")
        })?;
        set_path(&mut table, key.trim(), literal(value.trim()))
            .with_context(|| format!("--set {entry:?}"))?;
    }
    if !args.listen.is_empty() {
        let list = args.listen.iter().cloned().map(Value::String).collect();
        set_path(&mut table, "listeners.tcp", Value::Array(list))?;
    }
    if let Some(admin) = &args.admin {
        set_path(&mut table, "admin.listen", Value::String(admin.clone()))?;
    }
    if let Some(shards) = args.shards {
        let n = i64::try_from(shards).context("--shards is too large")?;
        set_path(&mut table, "server.shards", Value::Integer(n))?;
    }
    cluster_store_default(&mut table);
    let settings = deserialize(table)?;
    settings.validate()?;
    Ok(settings)
}

/// `store.kind` defaults to `"local"` on a single node (DESIGN.md §7);
/// with a `[cluster]` section and no `store.kind` given it is
/// `"jetstream"` (DESIGN.md §7, §15): a replica's values go to the
/// cluster's ingest stream, not to a local log.
fn cluster_store_default(table: &mut Table) {
    let has_cluster = table.contains_key("cluster");
    let has_kind = matches!(table.get("store"), Some(Value::Table(t)) if t.contains_key("kind"));
    if has_cluster && !has_kind {
        // `store` is a table or absent here (set_path only fails on a
        // non-table, which deserialising reports with its key).
        let _ = set_path(table, "store.kind", Value::String("jetstream".into()));
    }
}

/// The effective settings as a TOML document, as `fleetmq check-config`
/// prints them.
///
/// # Errors
///
/// Only if a value cannot be represented in TOML, which would be a bug.
pub fn to_toml(settings: &Settings) -> anyhow::Result<String> {
    let mut text = toml::to_string(settings).context("printing settings as TOML")?;
    // TOML has no "unset": say what the absent key means, under its table.
    if settings.auth.allow_anonymous.is_none() {
        let now = if settings.anonymous_allowed() {
            "accepted"
        } else {
            "refused"
        };
        let note = format!(
            "# allow_anonymous unset: anonymous clients are accepted exactly while \
             every listener is on loopback (here: {now}); set true or false to decide\n"
        );
        if let Some(at) = text.find("[auth]\n") {
            text.insert_str(at + "[auth]\n".len(), &note);
        }
    }
    if let Some(at) = text.find("\nauth_failure_threshold = ") {
        text.insert_str(at + 1, &failed_sign_in_note(&settings.limits));
    }
    Ok(text)
}

/// The comment `fleetmq check-config` prints above the failed sign-in
/// settings in `[limits]`: what they do together (README "Failed
/// sign-ins"; [`crate::auth::guard`]).
fn failed_sign_in_note(limits: &fleetmq_core::settings::Limits) -> String {
    let addresses = if limits.trust_client_addresses {
        "and per source address (trust_client_addresses = true)"
    } else {
        "not per source address (trust_client_addresses = false: an address may be a NAT)"
    };
    format!(
        "# Failed sign-ins (password file, JWT; not TLS identities) count per user name, {addresses}.\n\
         # auth_failure_threshold failures within auth_failure_window back it off for auth_failure_backoff,\n\
         # doubling up to auth_failure_backoff_max. Meanwhile only a known device is checked (same user name\n\
         # and client identifier, and address when trusted, as one of the last auth_known_devices successful\n\
         # sign-ins), with a backoff of its own; any other combination gets 0x87 unchecked, even with the\n\
         # right password. auth_check_rate_per_credential: checks per second per user name that may fail\n\
         # (a success gives its share back; beyond it 0x89 unchecked). auth_throttle_max_entries bounds each\n\
         # table. Metrics: fleetmq_auth_backoff_total{{decision}}, fleetmq_auth_throttle_entries{{table}}.\n"
    )
}

/// The largest settings file read (1 MiB): a real one is a few KiB, and
/// `--config /dev/zero` must not take the machine's memory (it grew to
/// 2.8 GB in 3 s before this bound).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The settings file at `path` as TOML. Refused before anything is read
/// when it is not a regular file (a device, a FIFO, a directory), and when
/// it holds more than [`MAX_CONFIG_BYTES`]; the error names the file and
/// the bound.
fn read_file(path: &Path) -> anyhow::Result<Table> {
    use std::io::Read;
    let reading = || format!("reading config file {}", path.display());
    // Asked before opening: opening a FIFO would wait for a writer.
    let meta = std::fs::metadata(path).with_context(reading)?;
    if !meta.is_file() {
        bail!(
            "config file {} is not a regular file (at most {MAX_CONFIG_BYTES} bytes are read from one)",
            path.display()
        );
    }
    let too_big = || {
        anyhow!(
            "config file {} is larger than {MAX_CONFIG_BYTES} bytes (1 MiB), the most read",
            path.display()
        )
    };
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(too_big());
    }
    // The file may grow after the look: read one byte past the bound at most.
    let mut text = String::new();
    std::fs::File::open(path)
        .with_context(reading)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .with_context(reading)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(too_big());
    }
    text.parse::<Table>()
        .with_context(|| format!("config file {} is not valid TOML", path.display()))
}

/// `FLEETMQ_LIMITS__MAX_PACKET_SIZE` → `limits.max_packet_size`.
fn env_key(name: &str) -> anyhow::Result<String> {
    let rest = &name[ENV_PREFIX.len()..];
    let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if parts.iter().any(String::is_empty) {
        bail!("environment variable {name}: expected {ENV_PREFIX}SECTION__KEY");
    }
    Ok(parts.join("."))
}

/// For a `FLEETMQ_` variable without `__` whose rest reads as a section, one
/// underscore and a key of that section (`FLEETMQ_LIMITS_MAX_CLIENTS`): the
/// dotted key it was meant to set. Other such variables are not settings
/// (Kubernetes, for one, injects `FLEETMQ_ADMIN_SERVICE_HOST` for a Service
/// named `fleetmq-admin`) and stay ignored.
fn one_underscore_key(name: &str) -> Option<String> {
    let rest = name.strip_prefix(ENV_PREFIX)?;
    if rest.contains("__") {
        return None;
    }
    let rest = rest.to_ascii_lowercase();
    rest.match_indices('_').find_map(|(at, _)| {
        let key = format!("{}.{}", &rest[..at], &rest[at + 1..]);
        is_setting(&key).then_some(key)
    })
}

/// Whether `key` (`section.key`) names a setting: its section is one the
/// settings print (not `[cluster]`, absent by default, whose keys are only
/// given with two underscores),
/// and deserializing a table that sets only it reports no unknown field (a
/// wrong type for the probe value is fine).
fn is_setting(key: &str) -> bool {
    let section = key.split('.').next().unwrap_or_default();
    let sections = Table::try_from(Settings::default()).unwrap_or_default();
    if !matches!(sections.get(section), Some(Value::Table(_))) {
        return false;
    }
    let mut table = Table::new();
    if set_path(&mut table, key, Value::Boolean(false)).is_err() {
        return false;
    }
    match serde_path_to_error::deserialize::<_, Settings>(Value::Table(table)) {
        Ok(_) => true,
        Err(e) => {
            let message = e.inner().message().to_owned();
            !message.starts_with("unknown field") && !message.starts_with("unknown variant")
        }
    }
}

/// Reads `text` as a TOML literal when it is one, else as a plain string.
fn literal(text: &str) -> Value {
    let doc = format!("v = {text}");
    match doc.parse::<Table>() {
        Ok(mut t) if t.len() == 1 => t.remove("v").unwrap_or_else(|| Value::String(text.into())),
        _ => Value::String(text.to_owned()),
    }
}

/// The parts of the dotted key `key`, read as TOML reads one, so a part
/// may be quoted to hold a dot (`shared.groups."eu.west"`, a share name
/// with a dot); a key TOML does not read is split at its dots as it is,
/// unless it holds a quote (a malformed quoted part: refused by
/// [`set_path`], not kept with its quotes).
fn key_parts(key: &str) -> Option<Vec<String>> {
    if let Ok(mut table) = format!("{key} = 0").parse::<Table>() {
        let mut parts = Vec::new();
        while table.len() == 1 {
            let (part, value) = table.into_iter().next().expect("one entry");
            parts.push(part);
            match value {
                Value::Table(inner) => table = inner,
                _ => return Some(parts),
            }
        }
    }
    if key.contains(['"', '\'']) {
        return None;
    }
    Some(key.split('.').map(|p| p.trim().to_owned()).collect())
}

/// Sets `table[a][b]...[z] = value` for the dotted key `a.b...z` (see
/// [`key_parts`]), creating tables on the way.
fn set_path(table: &mut Table, key: &str, value: Value) -> anyhow::Result<()> {
    let Some(parts) = key_parts(key) else {
        bail!("bad key {key:?}: a quoted part must be closed and be the whole part, e.g. shared.groups.\"eu.west\"");
    };
    // An empty quoted part (`shared.groups.""`) is a name, judged by what
    // it names (a share name: `Shared::validate`).
    if parts.iter().any(String::is_empty) && !key.contains(['"', '\'']) {
        bail!("bad key {key:?}: expected section.key, e.g. limits.max_clients");
    }
    let (last, sections) = parts.split_last().expect("split yields at least one part");
    let mut at = table;
    for (i, section) in sections.iter().enumerate() {
        let entry = at
            .entry(section.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        at = match entry {
            Value::Table(t) => t,
            _ => bail!("{} is a value, not a section", parts[..=i].join(".")),
        };
    }
    at.insert(last.to_string(), value);
    Ok(())
}

/// Deserializes the merged table, naming the dotted key of any error (an
/// unknown key, a wrong type, a bad unit). A whole number too large or
/// too small for its key's type is reported with the key's range, as
/// [`Settings::validate`] reports one within the type but out of range.
fn deserialize(table: Table) -> anyhow::Result<Settings> {
    serde_path_to_error::deserialize(Value::Table(table)).map_err(|e| {
        let path = dotted_key(e.path());
        // `message()` leaves out toml's own "in `key`" suffix: the path says it.
        let message = e.into_inner().message().to_owned();
        if path == "." {
            anyhow!("{message}")
        } else if let Some((value, range)) = integer_beyond_its_type(&path, &message) {
            anyhow!("{path} = {value} is out of range {range}")
        } else if let Some((value, range)) = too_large_for_its_key(&path, &message) {
            anyhow!("{path} = {value} is out of range {range}")
        } else if let Some((got, range)) = not_a_whole_number(&path, &message) {
            anyhow!("{path}: {got} is not a whole number; expected one in range {range}")
        } else {
            anyhow!("{path}: {message}")
        }
    })
}

/// `path` as the operator writes the key: parts joined by dots, each
/// quoted when TOML cannot take it bare (`shared.groups."a.b"`, not
/// serde_path_to_error's `shared.groups.a.b`), an index in brackets;
/// `.` for the whole table.
fn dotted_key(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut key = String::new();
    for segment in path {
        let part = match segment {
            Segment::Seq { index } => {
                key.push_str(&format!("[{index}]"));
                continue;
            }
            Segment::Map { key: part } | Segment::Enum { variant: part } => toml_key(part),
            Segment::Unknown => "?".to_owned(),
        };
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(&part);
    }
    if key.is_empty() {
        ".".to_owned()
    } else {
        key
    }
}

/// For serde's "invalid value: integer `70000`, expected u16" at `key`
/// (or "invalid type: string \"…\"" for digits past 64 bits): the value,
/// and the key's range. The range is what [`Settings::validate`]
/// says for the key set to the type's largest, then smallest, value (each
/// clamped to what TOML holds); when it accepts both, the type's own range.
fn integer_beyond_its_type(key: &str, message: &str) -> Option<(String, String)> {
    // Past 64 bits a number is no TOML integer, and arrives as a string.
    let (value, rest) = if let Some(rest) = message.strip_prefix("invalid value: integer `") {
        rest.split_once('`')?
    } else {
        let rest = message.strip_prefix("invalid type: string \"")?;
        let (value, rest) = rest.split_once('"')?;
        let digits = value.strip_prefix('-').unwrap_or(value);
        // Digits that fit in 64 bits came quoted ("5000"): a string where
        // a number belongs, not a number out of range (fresh-user pass
        // s47: `= 5000 is out of range 1..=10000000`).
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || value.parse::<i64>().is_ok() {
            return None;
        }
        (value, rest)
    };
    Some((value.to_owned(), integer_range(key, rest.strip_prefix(", expected ")?)?))
}

/// The range of `key`, a whole number of serde's type `expected` ("u32"):
/// what [`Settings::validate`] says for the key set to the type's
/// largest, then smallest, value (each clamped to what TOML holds); when
/// it accepts both, the type's own range. `None` for a type that is not
/// a whole number.
fn integer_range(key: &str, expected: &str) -> Option<String> {
    let (min, max): (i128, i128) = match expected {
        "u8" => (0, u8::MAX.into()),
        "u16" => (0, u16::MAX.into()),
        "u32" => (0, u32::MAX.into()),
        "u64" | "usize" => (0, u64::MAX.into()),
        "i8" => (i8::MIN.into(), i8::MAX.into()),
        "i16" => (i16::MIN.into(), i16::MAX.into()),
        "i32" => (i32::MIN.into(), i32::MAX.into()),
        "i64" | "isize" => (i64::MIN.into(), i64::MAX.into()),
        _ => return None,
    };
    let toml = |n: i128| n.clamp(i64::MIN.into(), i64::MAX.into()) as i64;
    Some(range_of(key, [toml(max), toml(min)]).unwrap_or_else(|| format!("{min}..={max}")))
}

/// For serde's "invalid type: string \"abc\", expected u32" at `key` (a
/// string, a float, a boolean where a whole number belongs): what was
/// given, and the key's range ([`integer_range`]).
fn not_a_whole_number(key: &str, message: &str) -> Option<(String, String)> {
    let (got, expected) = message.strip_prefix("invalid type: ")?.rsplit_once(", expected ")?;
    Some((got.to_owned(), integer_range(key, expected)?))
}

/// For a size or duration too large to hold at `key` (`parse_size`'s
/// "\"99999999999999999999B\" is too large"): the value, and the key's
/// range as [`Settings::validate`] says it for the largest whole number.
fn too_large_for_its_key(key: &str, message: &str) -> Option<(String, String)> {
    let quoted = message.strip_suffix(TOO_LARGE)?;
    let value = quoted.strip_prefix('"')?.strip_suffix('"')?;
    Some((value.to_owned(), range_of(key, [i64::MAX])?))
}

/// The range [`Settings::validate`] names for `key` when it is set to one
/// of the `probes` in turn (TOML integers: bytes for a size, seconds for a
/// duration), or `None` when it accepts every probe.
fn range_of(key: &str, probes: impl IntoIterator<Item = i64>) -> Option<String> {
    probes.into_iter().find_map(|probe| {
        let mut table = Table::new();
        set_path(&mut table, key, Value::Integer(probe)).ok()?;
        let settings: Settings = Value::Table(table).try_into().ok()?;
        match settings.validate() {
            Err(SettingsError::OutOfRange { key: k, range, .. }) if k == key => Some(range),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_fleetmq_variables_are_read_and_another_variable_in_latin_1_is_skipped() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let latin1 = || OsString::from_vec(b"caf\xe9".to_vec());
        let vars = vec![
            (OsString::from("UNRELATED_VAR"), latin1()),
            (latin1(), OsString::from("x")),
            (OsString::from("FLEETMQ_LIMITS__MAX_CLIENTS"), OsString::from("10")),
        ];
        let env = super::settings_env(vars).unwrap();
        assert_eq!(env, vec![("FLEETMQ_LIMITS__MAX_CLIENTS".to_owned(), "10".to_owned())]);
        let bad = vec![(OsString::from("FLEETMQ_LIMITS__MAX_TOPIC_BYTES"), latin1())];
        let e = super::settings_env(bad).unwrap_err().to_string();
        assert!(e.contains("FLEETMQ_LIMITS__MAX_TOPIC_BYTES") && e.contains("not valid UTF-8"), "{e}");
    }

    #[test]
    fn a_string_where_a_whole_number_belongs_names_the_key_and_its_range() {
        let mut a = args();
        a.set = vec!["limits.max_topic_bytes=abc".into()];
        let e = load_from(&a, Vec::new()).unwrap_err().to_string();
        assert!(e.starts_with("limits.max_topic_bytes: string \"abc\" is not a whole number; expected one in range "), "{e}");
        a.set = vec!["server.shards=1e3".into()];
        let e = load_from(&a, Vec::new()).unwrap_err().to_string();
        assert!(e.contains("server.shards: floating point") && e.contains("expected one in range"), "{e}");
    }

    #[test]
    fn a_set_key_part_may_be_quoted_to_hold_a_dot() {
        use fleetmq_core::shared::Strategy;
        let mut a = args();
        a.set = vec![r#"shared.groups."eu.west"=random"#.into(), "shared.groups.plain = sticky".into()];
        let settings = load_from(&a, Vec::new()).expect("quoted and plain group names");
        assert_eq!(settings.shared.strategy_for("eu.west"), Strategy::Random);
        assert_eq!(settings.shared.strategy_for("plain"), Strategy::Sticky);
        assert_eq!(key_parts("limits . max_clients"), Some(vec!["limits".to_owned(), "max_clients".to_owned()]));
        assert_eq!(key_parts("bad key.x"), Some(vec!["bad key".to_owned(), "x".to_owned()]), "not TOML: split at its dots");
        for malformed in [r#"shared.groups."a.b"#, r#"shared.groups."a"b""#, r#"shared.groups.a"b"#] {
            a.set = vec![format!("{malformed}=random")];
            let e = format!("{:#}", load_from(&a, Vec::new()).unwrap_err());
            assert!(e.contains("a quoted part must be closed"), "{malformed}: {e}");
        }
        a.set = vec![r#"shared.groups."a/b"=random"#.into()];
        let e = load_from(&a, Vec::new()).unwrap_err().to_string();
        assert!(e.contains(r#"shared.groups = "a/b" is not valid"#), "{e}");
        // An empty quoted name is judged as a share name, not as a key.
        a.set = vec![r#"shared.groups.""=random"#.into()];
        let e = load_from(&a, Vec::new()).unwrap_err().to_string();
        assert!(e.contains(r#"shared.groups = "" is not valid"#), "{e}");
        // A table where the strategy belongs: the key as written, what is
        // allowed, what was found (was: "shared.groups.a.b: unknown variant `c`").
        a.set = vec![r#"shared.groups."a.b".c=random"#.into()];
        let e = load_from(&a, Vec::new()).unwrap_err().to_string();
        assert_eq!(
            e,
            r#"shared.groups."a.b": expected a strategy (one of round_robin, random, sticky, hash_client_id, local_first), found a table { c = "random" }"#
        );
        a.set = vec!["shared..x=random".into()];
        let e = format!("{:#}", load_from(&a, Vec::new()).unwrap_err());
        assert!(e.contains("expected section.key"), "{e}");
    }

    use super::*;
    use std::time::Duration;

    fn args() -> ServeArgs {
        ServeArgs::default()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn load_err(args: &ServeArgs, vars: &[(&str, &str)]) -> String {
        format!("{:#}", load_from(args, env(vars)).expect_err("should fail"))
    }

    #[test]
    fn a_config_file_that_is_not_regular_or_over_1_mib_is_refused_unread() {
        // /dev/zero was read until memory ran out (2.8 GB in 3 s).
        let zero = ServeArgs { config: Some("/dev/zero".into()), ..args() };
        let err = load_err(&zero, &[]);
        assert!(err.contains("/dev/zero") && err.contains("not a regular file"), "{err}");
        assert!(err.contains("1048576"), "{err}");

        let big = file(&format!("# {}\n", "x".repeat(MAX_CONFIG_BYTES as usize)));
        let over = ServeArgs { config: Some(big.0.clone()), ..args() };
        let err = load_err(&over, &[]);
        assert!(err.contains(&big.0.display().to_string()) && err.contains("larger than 1048576 bytes"), "{err}");

        let just = file(&format!("#{}\n", "x".repeat(MAX_CONFIG_BYTES as usize - 2)));
        let at_bound = ServeArgs { config: Some(just.0.clone()), ..args() };
        load_from(&at_bound, env(&[])).expect("a file of exactly 1 MiB is read");
    }

    fn file(text: &str) -> tempfile_path::TempPath {
        tempfile_path::TempPath::with(text)
    }

    /// A file under the target temp dir removed on drop (no extra crate).
    mod tempfile_path {
        use std::path::PathBuf;
        use std::sync::atomic::{AtomicUsize, Ordering};

        pub(super) struct TempPath(pub(super) PathBuf);

        impl TempPath {
            pub(super) fn with(text: &str) -> TempPath {
                static N: AtomicUsize = AtomicUsize::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                let path = std::env::temp_dir()
                    .join(format!("fleetmq-config-{}-{n}.toml", std::process::id()));
                std::fs::write(&path, text).unwrap();
                TempPath(path)
            }
        }

        impl Drop for TempPath {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn nothing_given_means_the_defaults() {
        let s = load_from(&args(), env(&[])).unwrap();
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn the_store_is_local_on_a_single_node_and_jetstream_in_a_cluster_unless_given() {
        use fleetmq_core::settings::StoreKind;
        let single = load_from(&args(), env(&[])).unwrap();
        assert_eq!(single.store.kind, StoreKind::Local);
        let cluster = file("[cluster]\nreplica_id = \"r1\"\n");
        let mut a = args();
        a.config = Some(cluster.0.clone());
        assert_eq!(load_from(&a, env(&[])).unwrap().store.kind, StoreKind::Jetstream);
        a.set = vec!["store.kind=local".into()];
        assert_eq!(load_from(&a, env(&[])).unwrap().store.kind, StoreKind::Local);
    }

    #[test]
    fn a_setting_spelled_with_one_underscore_after_its_section_is_refused() {
        for (name, key, spelled) in [
            ("FLEETMQ_LIMITS_MAX_CLIENTS", "limits.max_clients", "FLEETMQ_LIMITS__MAX_CLIENTS"),
            ("FLEETMQ_AUTH_ALLOW_ANONYMOUS", "auth.allow_anonymous", "FLEETMQ_AUTH__ALLOW_ANONYMOUS"),
            ("fleetmq_server_shards", "server.shards", "FLEETMQ_SERVER__SHARDS"),
        ] {
            let name = name.to_ascii_uppercase();
            let e = load_err(&args(), &[(&name, "20")]);
            assert!(e.contains(&name) && e.contains(key) && e.contains(spelled), "{e}");
        }
        // What Kubernetes injects for Services named fleetmq-admin,
        // fleetmq-cluster and fleetmq is not a setting, and stays ignored.
        let injected = [
            ("FLEETMQ_ADMIN_SERVICE_HOST", "10.0.0.1"),
            ("FLEETMQ_ADMIN_PORT_8080_TCP_ADDR", "10.0.0.1"),
            ("FLEETMQ_CLUSTER_SERVICE_PORT", "4222"),
            ("FLEETMQ_PORT", "tcp://10.0.0.2:1883"),
            ("FLEETMQ_LIMITS_BOGUS", "1"),
        ];
        assert_eq!(load_from(&args(), env(&injected)).unwrap(), Settings::default());
    }

    #[test]
    fn each_layer_wins_over_the_one_below() {
        let f = file(
            "[limits]\nmax_packet_size = \"2MiB\"\nmax_clients = 10\nmax_topic_levels = 7\n\
             [server]\nshards = 3\n",
        );
        let mut a = args();
        a.config = Some(f.0.clone());
        a.set = vec![
            "limits.max_clients=30".into(),
            "limits.max_clients = 40".into(),
        ];
        a.shards = Some(2);
        let vars = [
            ("FLEETMQ_LIMITS__MAX_CLIENTS", "20"),
            ("FLEETMQ_LIMITS__MAX_PACKET_SIZE", "4MiB"),
            ("FLEETMQ_SERVER__SHARDS", "5"),
            ("FLEETMQ_BIN", "ignored: no double underscore"),
            ("PATH", "/bin"),
        ];
        let s = load_from(&a, env(&vars)).unwrap();
        assert_eq!(s.limits.max_topic_levels, 7, "file over default");
        assert_eq!(s.limits.max_packet_size, 4 << 20, "env over file");
        assert_eq!(s.limits.max_clients, 40, "--set over env, last --set wins");
        assert_eq!(s.server.shards, 2, "--shards over env and file");
    }

    #[test]
    fn listen_replaces_the_default_tcp_listeners() {
        let mut a = args();
        a.listen = vec!["127.0.0.1:0".into()];
        a.set = vec![r#"listeners.tcp=["127.0.0.1:1", "127.0.0.1:2"]"#.into()];
        a.admin = Some(String::new());
        let s = load_from(&a, env(&[])).unwrap();
        assert_eq!(s.listeners.tcp, vec!["127.0.0.1:0".to_string()]);
        assert_eq!(s.admin.listen, "");

        a.listen.clear();
        let s = load_from(&a, env(&[])).unwrap();
        assert_eq!(s.listeners.tcp, vec!["127.0.0.1:1", "127.0.0.1:2"]);
    }

    #[test]
    fn values_are_toml_literals_when_they_parse_and_strings_otherwise() {
        assert_eq!(literal("true"), Value::Boolean(true));
        assert_eq!(literal("5"), Value::Integer(5));
        assert_eq!(literal("\"5\""), Value::String("5".into()));
        assert_eq!(literal("10s"), Value::String("10s".into()));
        assert_eq!(
            literal("0.0.0.0:1883"),
            Value::String("0.0.0.0:1883".into())
        );
        assert_eq!(literal("1 # comment"), Value::Integer(1));
        assert_eq!(literal("a = 1\nb"), Value::String("a = 1\nb".into()));
        let mut a = args();
        a.set = vec![
            "auth.allow_anonymous=true".into(),
            "server.sys_interval=30s".into(),
            "limits.connect_timeout=7".into(),
        ];
        let s = load_from(&a, env(&[])).unwrap();
        assert_eq!(s.auth.allow_anonymous, Some(true));
        assert_eq!(s.server.sys_interval, Duration::from_secs(30));
        assert_eq!(s.limits.connect_timeout, Duration::from_secs(7));
    }

    #[test]
    fn an_unknown_key_is_an_error_naming_it() {
        let mut a = args();
        a.set = vec!["limits.max_packet_sise=1MiB".into()];
        let e = load_err(&a, &[]);
        assert!(e.contains("limits.max_packet_sise"), "{e}");

        let e = load_err(&args(), &[("FLEETMQ_NOPE__KEY", "1")]);
        assert!(e.contains("nope"), "{e}");

        let f = file("[limits]\nmax_clients = 5\nbogus = 1\n");
        let mut a = args();
        a.config = Some(f.0.clone());
        let e = load_err(&a, &[]);
        assert!(e.contains("limits.bogus"), "{e}");
    }

    #[test]
    fn a_bad_value_is_an_error_naming_its_key() {
        let mut a = args();
        a.set = vec!["limits.max_packet_size=lots".into()];
        let e = load_err(&a, &[]);
        assert!(e.contains("limits.max_packet_size"), "{e}");
        assert!(e.contains("invalid size"), "{e}");

        let e = load_err(&args(), &[("FLEETMQ_SERVER__SHARDS", "many")]);
        assert!(e.contains("server.shards"), "{e}");

        // A negative or fractional duration says what is expected.
        let mut a = args();
        a.set = vec!["limits.max_keep_alive=-1".into()];
        let e = load_err(&a, &[]);
        assert!(e.contains("limits.max_keep_alive") && e.contains("-1 is negative"), "{e}");
        assert!(e.contains(r#"a duration such as "30s""#), "{e}");
        a.set = vec!["limits.max_keep_alive=1.5".into()];
        let e = load_err(&a, &[]);
        assert!(e.contains("limits.max_keep_alive") && e.contains("expected a whole number"), "{e}");
    }

    #[test]
    fn out_of_range_values_are_refused_by_validation() {
        let e = load_err(&args(), &[("FLEETMQ_LIMITS__MAX_PACKET_SIZE", "10B")]);
        assert_eq!(
            e,
            "limits.max_packet_size = 10B is out of range 64B..=256MiB"
        );
        // A size in a unit past GiB names the range too, not "invalid size".
        let e = load_err(&args(), &[("FLEETMQ_STORE__MAX_BYTES", "99999TiB")]);
        assert_eq!(e, "store.max_bytes = 99999TiB is out of range 1MiB..=1TiB");
        let mut a = args();
        a.listen = vec!["0.0.0.0:1883".into()];
        let e = load_err(&a, &[]);
        assert!(e.contains("auth.allow_anonymous = true"), "{e}");
    }

    #[test]
    fn printed_settings_say_what_an_unset_allow_anonymous_means_and_read_back() {
        let settings = load_from(&args(), env(&[])).expect("defaults load");
        let text = to_toml(&settings).expect("prints");
        assert!(
            text.contains("[auth]\n# allow_anonymous unset: ") && text.contains("(here: accepted)"),
            "{text}"
        );
        let read: Settings = toml::from_str(&text).expect("the printed text is TOML");
        assert_eq!(read.auth.allow_anonymous, None);
        assert!(
            text.contains("[limits]\n") && text.contains("# Failed sign-ins (password file, JWT; not TLS identities) count per user name, not per source address")
                && text.contains("known device is checked (same user name\n# and client identifier")
                && text.contains("\n# table. Metrics: fleetmq_auth_backoff_total{decision}, fleetmq_auth_throttle_entries{table}.\nauth_failure_threshold = 10\n"),
            "{text}"
        );
        let mut a = args();
        a.set = vec!["auth.allow_anonymous=false".into()];
        let text = to_toml(&load_from(&a, env(&[])).expect("loads")).expect("prints");
        assert!(
            !text.contains("allow_anonymous unset") && text.contains("allow_anonymous = false"),
            "{text}"
        );
    }

    #[test]
    fn whole_numbers_beyond_their_type_are_refused_with_the_keys_range() {
        let mut a = args();
        a.set = vec!["limits.receive_maximum=70000".into()];
        assert_eq!(
            load_err(&a, &[]),
            "limits.receive_maximum = 70000 is out of range 1..=65535"
        );
        let e = load_err(&args(), &[("FLEETMQ_LIMITS__MAX_CLIENTS", "-1")]);
        assert_eq!(e, "limits.max_clients = -1 is out of range 1..=10000000");
        // Past 64 bits (2^70): no TOML integer, the same answer.
        a.set = vec!["limits.receive_maximum=1180591620717411303424".into()];
        assert_eq!(
            load_err(&a, &[]),
            "limits.receive_maximum = 1180591620717411303424 is out of range 1..=65535"
        );
        // A number in quotes is a string where a number belongs, not out
        // of range.
        a.set = vec!["limits.max_clients=\"5000\"".into()];
        let e = load_err(&a, &[]);
        assert_eq!(e, "limits.max_clients: string \"5000\" is not a whole number; expected one in range 1..=10000000");
        // A key whose validation accepts its whole type: the type's range.
        a.set = vec!["limits.topic_alias_maximum=65536".into()];
        let e = load_err(&a, &[]);
        assert_eq!(
            e,
            "limits.topic_alias_maximum = 65536 is out of range 0..=65535"
        );
    }

    #[test]
    fn sizes_and_durations_too_large_to_hold_are_refused_with_the_keys_range() {
        let mut a = args();
        for (set, said) in [
            (
                "limits.max_packet_size=99999999999999999999B",
                "limits.max_packet_size = 99999999999999999999B is out of range 64B..=256MiB",
            ),
            (
                "limits.max_packet_size=18014398509481984GiB",
                "limits.max_packet_size = 18014398509481984GiB is out of range 64B..=256MiB",
            ),
            (
                "server.sys_interval=99999999999999999999",
                "server.sys_interval = 99999999999999999999 is out of range 1s..=1h",
            ),
            (
                "server.sys_interval=99999999999999999999h",
                "server.sys_interval = 99999999999999999999h is out of range 1s..=1h",
            ),
        ] {
            a.set = vec![set.into()];
            assert_eq!(load_err(&a, &[]), said);
        }
        // Not a size at all: still the parser's explanation.
        a.set = vec!["limits.max_packet_size=lots".into()];
        assert!(load_err(&a, &[]).contains("invalid size \"lots\""));
    }

    #[test]
    fn malformed_input_is_explained() {
        let mut a = args();
        a.set = vec!["limits.max_clients".into()];
        assert!(load_err(&a, &[]).contains("expected KEY=VALUE"));
        a.set = vec!["limits..x=1".into()];
        assert!(load_err(&a, &[]).contains("bad key"));
        a.set = vec!["admin.listen=\"\"".into(), "admin.listen.x=1".into()];
        assert!(load_err(&a, &[]).contains("admin.listen is a value"));

        let mut a = args();
        a.config = Some("/nonexistent/fleetmq.toml".into());
        assert!(load_err(&a, &[]).contains("reading config file /nonexistent/fleetmq.toml"));
        let f = file("[limits\n");
        a.config = Some(f.0.clone());
        assert!(load_err(&a, &[]).contains("is not valid TOML"));
    }

    #[test]
    fn printed_settings_load_back_unchanged() {
        let mut a = args();
        a.set = vec![
            "limits.max_keep_alive=1h".into(),
            "auth.allow_anonymous=false".into(),
        ];
        let s = load_from(&a, env(&[])).unwrap();
        let f = file(&to_toml(&s).unwrap());
        let mut b = args();
        b.config = Some(f.0.clone());
        assert_eq!(load_from(&b, env(&[])).unwrap(), s);
    }
}
