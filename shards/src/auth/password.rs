//! The password file and `fleetmq passwd` (DESIGN.md §9, §15).
//!
//! One user a line, `user:$argon2id$v=19$m=19456,t=2,p=1$SALT$HASH`, with an
//! optional third field naming the user's workspace
//! (`user:HASH:workspace`; `default` when absent). Blank lines and lines
//! starting with `#` are ignored and kept when `fleetmq passwd` rewrites the
//! file. User and workspace names cannot contain `:` or line breaks; a
//! workspace name follows [`check_workspace`] (1 to 64 bytes, none of
//! whitespace, control characters, `.` `*` `>` `/` `\` `+` `#`): it becomes
//! a NATS subject token and a stream name.
//!
//! Hashes are argon2id with the OWASP parameters (19 MiB, 2 passes, 1 lane),
//! so one verification costs tens of milliseconds of CPU: callers run it off
//! the shard threads.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use fleetmq_core::cluster::names::check_workspace;
use rand::RngCore;

/// The workspace of users whose line has no third field.
pub const DEFAULT_WORKSPACE: &str = "default";

/// A hash of a random password with the default parameters, verified
/// against when the user is unknown so that unknown and known users take
/// the same time to refuse.
const DUMMY_HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c29tZXNhbHRzb21lc2FsdA$ow5B4Q8t0Dc7gxk3NSs8L9CFJ5C+6LLCzE9aLe3oy2A";

/// Hashes `password` with argon2id (m = 19456 KiB, t = 2, p = 1, random
/// 16-byte salt) into a PHC string `$argon2id$v=19$...`.
///
/// # Panics
///
/// Never in practice: argon2 fails only on parameters out of its range, and
/// these are its defaults.
pub fn hash_password(password: &str) -> String {
    let mut salt = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut salt);
    let salt = SaltString::encode_b64(&salt).expect("16 bytes is a valid salt");
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .expect("default argon2 parameters are valid")
        .to_string()
}

/// Whether `password` matches the PHC string `hash`. A malformed hash never
/// matches.
pub fn verify_password(hash: &str, password: &[u8]) -> bool {
    PasswordHash::new(hash)
        .is_ok_and(|parsed| Argon2::default().verify_password(password, &parsed).is_ok())
}

/// Why a password file's text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct PasswordFileError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct UserEntry {
    hash: String,
    workspace: Option<String>,
}

/// A parsed password file: user name → argon2 hash and workspace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PasswordFile {
    users: HashMap<String, UserEntry>,
}

impl PasswordFile {
    /// Parses the text of a password file.
    ///
    /// # Errors
    ///
    /// The first bad line: no `:`, an empty user name, a hash that is not a
    /// PHC string, an empty workspace, extra fields, or a user named twice.
    pub fn parse(text: &str) -> Result<PasswordFile, PasswordFileError> {
        let mut users = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |message: String| PasswordFileError {
                line: i + 1,
                message,
            };
            let (user, entry) = parse_line(line).map_err(err)?;
            if users.insert(user.to_owned(), entry).is_some() {
                return Err(err(format!("user {user:?} appears twice")));
            }
        }
        Ok(PasswordFile { users })
    }

    /// Reads and parses the password file at `path`.
    ///
    /// # Errors
    ///
    /// The file cannot be read, or [`PasswordFile::parse`] refuses it; the
    /// message names the file.
    pub fn load(path: &Path) -> anyhow::Result<PasswordFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("password file {}", path.display()))?;
        PasswordFile::parse(&text).with_context(|| format!("password file {}", path.display()))
    }

    /// The user's workspace when `password` is theirs, else `None`. Costs
    /// one argon2 verification whether or not the user exists.
    pub fn verify(&self, user: &str, password: &[u8]) -> Option<String> {
        match self.users.get(user) {
            Some(entry) if verify_password(&entry.hash, password) => Some(
                entry
                    .workspace
                    .clone()
                    .unwrap_or_else(|| DEFAULT_WORKSPACE.to_owned()),
            ),
            Some(_) => None,
            None => {
                let _ = verify_password(DUMMY_HASH, password);
                None
            }
        }
    }

    /// The workspace of `user` if the file names them, without checking a
    /// password (for users identified by a TLS client certificate).
    pub fn workspace_of(&self, user: &str) -> Option<&str> {
        let entry = self.users.get(user)?;
        Some(entry.workspace.as_deref().unwrap_or(DEFAULT_WORKSPACE))
    }

    /// Number of users.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether the file names no user.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }
}

fn parse_line(line: &str) -> Result<(&str, UserEntry), String> {
    let mut fields = line.split(':');
    let user = fields.next().unwrap_or_default();
    let Some(hash) = fields.next() else {
        return Err("expected `user:hash[:workspace]`".to_owned());
    };
    if user.is_empty() {
        return Err("empty user name".to_owned());
    }
    if let Err(e) = PasswordHash::new(hash) {
        return Err(format!("user {user:?}: the hash is not a PHC string ({e})"));
    }
    let workspace = match fields.next() {
        None => None,
        Some("") => return Err(format!("user {user:?}: empty workspace")),
        Some(w) => match check_workspace(w) {
            Ok(()) => Some(w.to_owned()),
            Err(e) => return Err(format!("user {user:?}: the workspace {w:?} {e}")),
        },
    };
    if fields.next().is_some() {
        return Err(format!("user {user:?}: more than three fields"));
    }
    let hash = hash.to_owned();
    Ok((user, UserEntry { hash, workspace }))
}

fn check_name(what: &str, name: &str) -> anyhow::Result<()> {
    if name.is_empty() {
        bail!("the {what} is empty");
    }
    if name.contains([':', '\n', '\r']) || name.starts_with('#') || name.trim() != name {
        bail!(
            "the {what} {name:?} contains `:`, a line break, surrounding spaces or a leading `#`"
        );
    }
    Ok(())
}

/// What [`set_user`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserSet {
    /// The user was not in the file and was added.
    pub added: bool,
    /// The user's workspace now.
    pub workspace: String,
    /// The user's workspace before, when the change moved them to another.
    pub moved_from: Option<String>,
}

/// Adds `user` to the password file at `path`, or changes their password.
/// `workspace` puts the user in that workspace; without it, an existing
/// user keeps theirs and a new one is in [`DEFAULT_WORKSPACE`]. Creates the
/// file (mode 0600) when it does not exist; other lines, comments included,
/// are kept. The file is replaced atomically (temporary file in the same
/// folder, then rename).
///
/// # Errors
///
/// A bad user or workspace name, an existing file that does not parse, or
/// an I/O error; messages name the file.
pub fn set_user(
    path: &Path,
    user: &str,
    password: &str,
    workspace: Option<&str>,
) -> anyhow::Result<UserSet> {
    check_name("user name", user)?;
    if let Some(w) = workspace {
        check_name("workspace", w)?;
        check_workspace(w).map_err(|e| anyhow::anyhow!("the workspace {w:?} {e}"))?;
    }
    let (mut lines, index, file) = read_lines(path, user)?;
    let existing = file.users.get(user).map(|e| e.workspace.as_deref());
    // An existing line without a workspace stays without one (`default`).
    let kept = workspace.or(existing.flatten());
    let mut line = format!("{user}:{}", hash_password(password));
    if let Some(w) = kept {
        line.push(':');
        line.push_str(w);
    }
    match index {
        Some(i) => lines[i] = line,
        None => lines.push(line),
    }
    write_atomically(path, &lines)?;
    let now = kept.unwrap_or(DEFAULT_WORKSPACE).to_owned();
    let before = existing.map(|w| w.unwrap_or(DEFAULT_WORKSPACE));
    Ok(UserSet {
        added: existing.is_none(),
        moved_from: before.filter(|b| *b != now).map(str::to_owned),
        workspace: now,
    })
}

/// Removes `user` from the password file at `path`, atomically as in
/// [`set_user`]. Returns whether the user was there (the file is left
/// untouched when not).
///
/// # Errors
///
/// The file cannot be read, does not parse, or cannot be replaced.
pub fn delete_user(path: &Path, user: &str) -> anyhow::Result<bool> {
    let (mut lines, index, _) = read_lines(path, user)?;
    let Some(i) = index else {
        return Ok(false);
    };
    lines.remove(i);
    write_atomically(path, &lines)?;
    Ok(true)
}

/// The file's lines (empty when it does not exist), the index of `user`'s
/// line, and the file parsed.
fn read_lines(
    path: &Path,
    user: &str,
) -> anyhow::Result<(Vec<String>, Option<usize>, PasswordFile)> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("password file {}", path.display())),
    };
    let file =
        PasswordFile::parse(&text).with_context(|| format!("password file {}", path.display()))?;
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let index = lines.iter().position(|l| {
        let l = l.trim();
        !l.starts_with('#') && l.split(':').next() == Some(user) && l.contains(':')
    });
    Ok((lines, index, file))
}

fn write_atomically(path: &Path, lines: &[String]) -> anyhow::Result<()> {
    let ctx = || format!("writing password file {}", path.display());
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .context("the path has no file name")
        .with_context(ctx)?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> std::io::Result<()> {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let mut file = options.open(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            file.set_permissions(meta.permissions())?;
        }
        for line in lines {
            file.write_all(line.as_bytes())?;
            file.write_all(b"\n")?;
        }
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(ctx)
}

/// Arguments of `fleetmq passwd FILE USER [--password-stdin] [--delete]
/// [--workspace W]` (DESIGN.md §15).
#[derive(Debug, Clone, clap::Args)]
pub struct PasswdArgs {
    /// The password file; created when missing.
    pub file: PathBuf,
    /// The user to add, change or delete.
    pub user: String,
    /// Read the password from the first line of standard input instead of
    /// prompting twice.
    #[arg(long, conflicts_with = "delete")]
    pub password_stdin: bool,
    /// Remove the user instead.
    #[arg(long)]
    pub delete: bool,
    /// The user's workspace. Without it, a user already in the file keeps
    /// theirs and a new user is in `default`.
    #[arg(long, value_name = "W", conflicts_with = "delete")]
    pub workspace: Option<String>,
}

/// Carries out `fleetmq passwd` and returns the line to print on success.
///
/// # Errors
///
/// Mismatched or empty passwords, an unknown user for `--delete`, or any
/// error of [`set_user`] / [`delete_user`].
pub fn run_passwd(args: &PasswdArgs) -> anyhow::Result<String> {
    let file = args.file.display();
    if args.delete {
        if !delete_user(&args.file, &args.user)? {
            bail!("user {:?} is not in {file}", args.user);
        }
        return Ok(format!("deleted user {:?} from {file}", args.user));
    }
    let password = if args.password_stdin {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .context("reading the password from standard input")?;
        line.trim_end_matches(['\n', '\r']).to_owned()
    } else {
        let first = rpassword::prompt_password("Password: ")
            .context("reading the password from the terminal (without one, use --password-stdin)")?;
        let again =
            rpassword::prompt_password("Password again: ").context("reading the password")?;
        if first != again {
            bail!("the passwords do not match");
        }
        first
    };
    if password.is_empty() {
        bail!("the password is empty");
    }
    let set = set_user(&args.file, &args.user, &password, args.workspace.as_deref())?;
    Ok(set_message(&args.user, &args.file, &set))
}

/// The line `fleetmq passwd` prints after [`set_user`]: whether the user was
/// added or changed, and their workspace (kept, or moved from which).
fn set_message(user: &str, file: &Path, set: &UserSet) -> String {
    let (file, workspace) = (file.display(), &set.workspace);
    if set.added {
        return format!("added user {user:?} (workspace {workspace:?}) to {file}");
    }
    let how = match &set.moved_from {
        Some(before) => format!("moved from workspace {before:?}"),
        None => "kept".to_owned(),
    };
    format!("set the password of user {user:?} (workspace {workspace:?}, {how}) in {file}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("fleetmq-passwd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_hash_verifies_its_password_and_no_other() {
        let hash = hash_password("hunter2");
        assert!(
            hash.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"),
            "{hash}"
        );
        assert!(verify_password(&hash, b"hunter2"));
        assert!(!verify_password(&hash, b"hunter3"));
        assert_ne!(hash, hash_password("hunter2"), "salts differ");
        assert!(!verify_password("not a hash", b"hunter2"));
    }

    #[test]
    fn the_dummy_hash_is_well_formed() {
        assert!(PasswordHash::new(DUMMY_HASH).is_ok());
    }

    #[test]
    fn a_file_round_trips_through_set_and_delete() {
        let dir = temp_dir("roundtrip");
        let path = dir.join("passwd");
        std::fs::write(&path, "# fleet users\n\n").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions();
        set_user(&path, "alice", "a-secret", None).unwrap();
        set_user(&path, "bob", "b-secret", Some("acme")).unwrap();
        let file = PasswordFile::load(&path).unwrap();
        assert_eq!(file.len(), 2);
        assert_eq!(
            file.verify("alice", b"a-secret").as_deref(),
            Some("default")
        );
        assert_eq!(file.verify("bob", b"b-secret").as_deref(), Some("acme"));
        assert_eq!(file.verify("bob", b"a-secret"), None);
        assert_eq!(file.verify("carol", b"a-secret"), None);
        assert_eq!(file.workspace_of("bob"), Some("acme"));

        set_user(&path, "alice", "new-secret", Some("acme")).unwrap();
        assert!(delete_user(&path, "bob").unwrap());
        assert!(!delete_user(&path, "bob").unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# fleet users\n"), "comments kept: {text}");
        let file = PasswordFile::load(&path).unwrap();
        assert_eq!(file.len(), 1);
        assert_eq!(file.verify("alice", b"new-secret").as_deref(), Some("acme"));
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions(),
            mode,
            "mode kept"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_new_password_without_a_workspace_keeps_the_users_workspace() {
        let dir = temp_dir("keep-workspace");
        let path = dir.join("passwd");
        let set = set_user(&path, "bob", "b-secret", Some("acme")).unwrap();
        assert!(set.added);
        assert_eq!(set.workspace, "acme");

        let set = set_user(&path, "bob", "b-new", None).unwrap();
        assert_eq!(
            set,
            UserSet {
                added: false,
                workspace: "acme".into(),
                moved_from: None
            }
        );
        let file = PasswordFile::load(&path).unwrap();
        assert_eq!(file.verify("bob", b"b-new").as_deref(), Some("acme"));
        assert!(
            set_message("bob", &path, &set).contains("(workspace \"acme\", kept)"),
            "{}",
            set_message("bob", &path, &set)
        );

        let set = set_user(&path, "bob", "b-newer", Some("beta")).unwrap();
        assert_eq!(set.moved_from.as_deref(), Some("acme"));
        assert!(set_message("bob", &path, &set)
            .contains("(workspace \"beta\", moved from workspace \"acme\")"));
        assert_eq!(
            PasswordFile::load(&path).unwrap().workspace_of("bob"),
            Some("beta")
        );

        // A line without a workspace stays without one.
        set_user(&path, "alice", "a-secret", None).unwrap();
        let set = set_user(&path, "alice", "a-new", None).unwrap();
        assert_eq!((set.workspace.as_str(), set.moved_from), ("default", None));
        let text = std::fs::read_to_string(&path).unwrap();
        let alice = text.lines().find(|l| l.starts_with("alice:")).unwrap();
        assert_eq!(alice.matches(':').count(), 1, "{alice}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_new_file_is_readable_by_its_owner_only() {
        let dir = temp_dir("mode");
        let path = dir.join("passwd");
        set_user(&path, "alice", "pw", None).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_lines_are_refused_with_their_line_number() {
        let hash = DUMMY_HASH;
        let cases = [
            ("nocolon\n", 1, "expected"),
            (&format!("# c\n:{hash}\n"), 2, "empty user"),
            ("alice:plaintext\n", 1, "not a PHC string"),
            (&format!("alice:{hash}:\n"), 1, "empty workspace"),
            (&format!("alice:{hash}:w:x\n"), 1, "more than three"),
            // A workspace name becomes a NATS subject token and a stream
            // name: the rule of check_workspace, named.
            (&format!("bob:{hash}:plant.north\n"), 1, "the workspace \"plant.north\" contains '.'"),
            (&format!("bob:{hash}:a/b\n"), 1, "contains '/'"),
            (&format!("bob:{hash}:{}\n", "w".repeat(65)), 1, "at most 64 bytes"),
            (&format!("alice:{hash}\n\nalice:{hash}\n"), 3, "twice"),
        ];
        for (text, line, needle) in cases {
            let err = PasswordFile::parse(text).unwrap_err();
            assert_eq!(err.line, line, "{text}");
            assert!(err.to_string().contains(needle), "{err}");
        }
    }

    #[test]
    fn names_with_colons_or_line_breaks_are_refused() {
        let dir = temp_dir("names");
        let path = dir.join("passwd");
        assert!(set_user(&path, "a:b", "pw", None).is_err());
        assert!(set_user(&path, "a\nb", "pw", None).is_err());
        assert!(set_user(&path, "a", "pw", Some("w:x")).is_err());
        let err = set_user(&path, "a", "pw", Some("w>x")).unwrap_err();
        assert!(err.to_string().contains("contains '>'"), "{err}");
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_file_is_not_overwritten() {
        let dir = temp_dir("broken");
        let path = dir.join("passwd");
        std::fs::write(&path, "garbage\n").unwrap();
        let err = set_user(&path, "alice", "pw", None).unwrap_err();
        assert!(format!("{err:#}").contains("line 1"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "garbage\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
