//! Sign-in and authorization (DESIGN.md §9): who a client is, which
//! workspace it belongs to, and what it may publish and subscribe to.
//!
//! [`Authenticator`] is built once from the settings and shared by every
//! shard in an `Arc`. Its [`Authenticator::authenticate`] is synchronous and
//! CPU-heavy (argon2): the connection code runs it off the shard thread.
//! Submodules: [`password`] (the password file and `fleetmq passwd`),
//! [`jwt`] (tokens as passwords), [`acl`] (the ACL file), and [`guard`]
//! (which credential checks run, with [`throttle`] for the failed sign-in
//! backoff, [`devices`] for the devices it recognises and [`budget`] for
//! the checks per user name).

pub mod acl;
pub mod budget;
pub mod devices;
pub mod guard;
pub mod jwt;
pub mod password;
pub mod throttle;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use anyhow::Context;
use fleetmq_core::settings::Settings;

use self::acl::Acl;
use self::guard::{Guard, GuardConfig, Refusal, Verdict};
use self::jwt::JwtVerifier;
use self::password::{PasswordFile, DEFAULT_WORKSPACE};
use crate::metrics::SignInMetrics;

/// Who a signed-in client is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The verified user name; `None` for anonymous clients.
    pub username: Option<Arc<str>>,
    /// The user's workspace; `"default"` when none is set (see
    /// [`workspace_name`]).
    pub workspace: Arc<str>,
    /// When the credential stops being valid (a JWT's `exp`): the
    /// connection is closed then (MQTT 5: DISCONNECT 0xA0, Maximum connect
    /// time). `None`: never.
    pub expires_at: Option<SystemTime>,
}

/// `name` as an [`Identity`]'s workspace: every client of the default
/// workspace shares one allocation, so a connection holds only a count on
/// it (an idle connection should cost little, DESIGN.md §3).
pub fn workspace_name(name: &str) -> Arc<str> {
    static DEFAULT: std::sync::LazyLock<Arc<str>> =
        std::sync::LazyLock::new(|| Arc::from(DEFAULT_WORKSPACE));
    if name == DEFAULT_WORKSPACE {
        DEFAULT.clone()
    } else {
        Arc::from(name)
    }
}

impl Identity {
    fn anonymous(username: Option<&str>) -> Identity {
        Identity {
            username: username.map(Arc::from),
            workspace: workspace_name(DEFAULT_WORKSPACE),
            expires_at: None,
        }
    }
}

/// What a client presented in CONNECT and on its connection.
#[derive(Debug, Clone, Copy)]
pub struct Credentials<'a> {
    /// CONNECT user name.
    pub username: Option<&'a str>,
    /// CONNECT password (binary in MQTT 5).
    pub password: Option<&'a [u8]>,
    /// CONNECT client ID.
    pub client_id: &'a str,
    /// The client's address (the socket's peer). It counts in the failed
    /// sign-in throttle only with `limits.trust_client_addresses`.
    pub peer: IpAddr,
    /// The TLS client certificate's identity ([`crate::tls::peer_identity`])
    /// when `tls.use_identity_as_username` is on; `None` otherwise.
    pub tls_identity: Option<&'a str>,
}

/// Why a sign-in was refused. [`AuthError::connack_v5`] and
/// [`AuthError::connack_v3`] give the CONNACK codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// Credentials were presented and are wrong: unknown user, wrong
    /// password, or a JWT that fails a check. CONNACK 0x86 (3.1.1: 4).
    #[error("bad user name or password")]
    BadCredentials,
    /// No credentials while anonymous clients are not allowed. CONNACK 0x87
    /// (3.1.1: 5).
    #[error("not authorized")]
    NotAuthorized,
    /// The user name (or, with `limits.trust_client_addresses`, the source
    /// address) is backing off after repeated failures and this
    /// combination of user name and client identifier did not sign in
    /// recently, or did and backs off itself ([`guard`]); the credentials
    /// were not checked. CONNACK 0x87 (3.1.1: 5):
    /// "not authorized" is true of this attempt, is understood by every
    /// client, and tells a guesser nothing about the password. (MQTT 5's
    /// 0x9F Connection rate exceeded would describe a rate limit, which this
    /// is not quite; 0x8A Banned suggests permanence.)
    #[error("too many failed sign-ins, backing off")]
    Throttled,
    /// The user name spent its budget of failing checks
    /// (`limits.auth_check_rate_per_credential`); the credentials were not
    /// checked. CONNACK 0x89 Server busy (3.1.1: 3 Server unavailable):
    /// the client may try again shortly.
    #[error("too many credential checks for this user name, try again")]
    Busy,
    /// The credentials are good but name a workspace fleetmq cannot keep
    /// (a JWT's workspace claim breaking
    /// [`fleetmq_core::cluster::names::check_workspace`]; a password
    /// file's workspaces are checked when it is read). CONNACK 0x87 Not
    /// authorized (3.1.1: 5): the client is who it says, and is not let in
    /// as that identity. Not 0x86, which says the user name or password
    /// is malformed or wrong (the client could fix it; here the issuer
    /// must); not 0x85, which is about the Client Identifier; not 0x8C,
    /// which is about the AUTH method of enhanced authentication.
    #[error("the credentials name a workspace that breaks the naming rule")]
    WorkspaceInvalid,
}

impl AuthError {
    /// The MQTT 5 CONNACK reason code.
    pub fn connack_v5(self) -> u8 {
        match self {
            AuthError::BadCredentials => 0x86,
            AuthError::NotAuthorized | AuthError::Throttled | AuthError::WorkspaceInvalid => 0x87,
            AuthError::Busy => 0x89,
        }
    }

    /// The MQTT 3.1.1 CONNACK return code.
    pub fn connack_v3(self) -> u8 {
        match self {
            AuthError::BadCredentials => 4,
            AuthError::NotAuthorized | AuthError::Throttled | AuthError::WorkspaceInvalid => 5,
            AuthError::Busy => 3,
        }
    }
}

/// A sign-in [`Authenticator::admit`] let through, to be checked with
/// [`Authenticator::check_admitted`] (which settles it with the guard).
/// `Send`: it goes to the blocking thread with the credentials.
#[derive(Debug, Clone, Copy)]
#[must_use = "check it with Authenticator::check_admitted"]
pub struct Admitted {
    /// The guard's keys and verdict, when the check verifies a secret.
    guarded: Option<(guard::Attempt, Verdict)>,
}

impl Admitted {
    /// Whether the check verifies a password (argon2, milliseconds) or a
    /// JWT, and so belongs off the shard thread. TLS identities and the
    /// anonymous rule are checked at once.
    pub fn is_costly(&self) -> bool {
        self.guarded.is_some()
    }

    /// Whether the guard recognised a known device: the same user name
    /// and client identifier (and, with trusted addresses, address) as a
    /// sign-in that succeeded, checked on the known devices' own budget.
    /// Its check goes first in the shard's queue (`crate::signin`).
    pub fn is_known_device(&self) -> bool {
        matches!(self.guarded, Some((_, Verdict::Check { known: true, .. })))
    }
}

/// Files the authenticator reads, and how it treats them.
#[derive(Debug, Clone)]
struct Sources {
    password_file: Option<PathBuf>,
    acl_file: Option<PathBuf>,
    jwt: fleetmq_core::settings::Jwt,
    anonymous: bool,
    tls_identity: bool,
}

/// What was loaded from the files; replaced whole on reload.
#[derive(Debug, Clone, Default)]
struct Loaded {
    passwords: Option<Arc<PasswordFile>>,
    acl: Option<Arc<Acl>>,
    jwt: Option<Arc<JwtVerifier>>,
}

/// Checks credentials (password file, JWT, TLS identity, anonymous rule)
/// with a failed sign-in guard, and holds the ACL. `Send + Sync`.
#[derive(Debug)]
pub struct Authenticator {
    sources: Sources,
    loaded: RwLock<Loaded>,
    guard: Guard,
    sign_in_metrics: SignInMetrics,
}

impl Authenticator {
    /// From settings: the anonymous rule ([`Settings::anonymous_allowed`]),
    /// `auth.password_file`, `auth.acl_file`, `[auth.jwt]`,
    /// `tls.use_identity_as_username`, and the failed sign-in guard from
    /// `limits` ([`GuardConfig::from_limits`]).
    ///
    /// # Errors
    ///
    /// A configured file that cannot be read or parsed; the message names
    /// the file and the problem (e.g. `ACL file acl.txt: line 3: ...`).
    pub fn from_settings(settings: &Settings) -> anyhow::Result<Authenticator> {
        let path = |s: &str| (!s.is_empty()).then(|| PathBuf::from(s));
        let sources = Sources {
            password_file: path(&settings.auth.password_file),
            acl_file: path(&settings.auth.acl_file),
            jwt: settings.auth.jwt.clone(),
            anonymous: settings.anonymous_allowed(),
            tls_identity: settings.tls.use_identity_as_username,
        };
        let loaded = Loaded {
            passwords: load_passwords(sources.password_file.as_deref())?,
            acl: load_acl(sources.acl_file.as_deref())?,
            jwt: load_jwt(&sources.jwt)?,
        };
        let sign_in_metrics = SignInMetrics::default();
        Ok(Authenticator {
            sources,
            loaded: RwLock::new(loaded),
            guard: Guard::new(
                &GuardConfig::from_limits(&settings.limits),
                sign_in_metrics.clone(),
            ),
            sign_in_metrics,
        })
    }

    /// Verifies `creds` at `now`. CPU-heavy (argon2): run it off the shard
    /// thread.
    ///
    /// Order: the TLS identity (when `tls.use_identity_as_username` is on
    /// and the client presented a certificate; its workspace comes from the
    /// password file when the file names that user) → a JWT (when the
    /// password looks like one and `[auth.jwt]` is configured) → the
    /// password file → anonymous (no user name and no password, and
    /// anonymous clients allowed). When no credential source is configured
    /// and anonymous clients are allowed, a client's user name is taken as
    /// given, unverified, as Mosquitto does.
    ///
    /// The failed sign-in guard ([`guard`]) applies to the checks that
    /// verify a secret (a password against the file, a JWT): during a
    /// backoff of the user name (or of the address, when addresses are
    /// trusted) only a combination that signed in before is checked; the
    /// failing checks per user name are bounded per second. A TLS identity
    /// was proven in the handshake and is not throttled.
    ///
    /// # Errors
    ///
    /// [`AuthError::BadCredentials`] for wrong credentials,
    /// [`AuthError::NotAuthorized`] for missing ones,
    /// [`AuthError::Throttled`] while backing off,
    /// [`AuthError::Busy`] when the user name's check budget is spent.
    pub fn authenticate(
        &self,
        creds: &Credentials,
        now: SystemTime,
    ) -> Result<Identity, AuthError> {
        let admitted = self.admit(creds, now)?;
        self.check_admitted(creds, admitted, now)
    }

    /// The failed sign-in guard's decision on `creds` at `now`, taken
    /// before any costly work: cheap (a lock and a few hash lookups), so
    /// the connection code runs it on the shard, and only an admitted
    /// sign-in that [`Admitted::is_costly`] goes to a blocking thread.
    ///
    /// # Errors
    ///
    /// [`AuthError::Throttled`] while backing off, [`AuthError::Busy`]
    /// when the user name's check budget is spent.
    pub fn admit(&self, creds: &Credentials, now: SystemTime) -> Result<Admitted, AuthError> {
        if !self.verifies_a_secret(&self.loaded(), creds) {
            return Ok(Admitted { guarded: None });
        }
        let attempt = self
            .guard
            .attempt(creds.username, creds.client_id, creds.peer);
        match self.guard.admit(&attempt, now) {
            verdict @ Verdict::Check { .. } => Ok(Admitted {
                guarded: Some((attempt, verdict)),
            }),
            Verdict::Refuse(Refusal::OverBudget) => Err(AuthError::Busy),
            Verdict::Refuse(_) => Err(AuthError::Throttled),
        }
    }

    /// Whether signing in `creds` verifies a password or a JWT: the costly
    /// check ([`Admitted::is_costly`]) that waits in a shard's queue of
    /// checks. Cheap (a load of the credential sources); records nothing.
    pub fn verifies_secret(&self, creds: &Credentials) -> bool {
        self.verifies_a_secret(&self.loaded(), creds)
    }

    /// Gives back what [`Authenticator::admit`] reserved for a check that
    /// will not run (its turn never came): the user name's budget share.
    pub fn abandon(&self, admitted: Admitted, now: SystemTime) {
        if let Some((attempt, verdict)) = admitted.guarded {
            self.guard.abandon(&attempt, verdict, now);
        }
    }

    /// Checks `creds`, which [`Authenticator::admit`] let through as
    /// `admitted`, at `now`, and records the outcome with the guard.
    /// CPU-heavy when `admitted` [`Admitted::is_costly`].
    ///
    /// # Errors
    ///
    /// As [`Authenticator::authenticate`], but never
    /// [`AuthError::Throttled`] or [`AuthError::Busy`].
    pub fn check_admitted(
        &self,
        creds: &Credentials,
        admitted: Admitted,
        now: SystemTime,
    ) -> Result<Identity, AuthError> {
        let result = self.check(&self.loaded(), creds, now);
        if let Some((attempt, verdict)) = admitted.guarded {
            self.guard.settle(&attempt, verdict, result.is_ok(), now);
        }
        result
    }

    /// Whether [`Authenticator::check`] of `creds` verifies a password or
    /// a JWT (and so is guarded), rather than taking a TLS identity or
    /// applying the anonymous rule.
    fn verifies_a_secret(&self, loaded: &Loaded, creds: &Credentials) -> bool {
        if self.sources.tls_identity && creds.tls_identity.is_some() {
            return false;
        }
        let Some(password) = creds.password else {
            return false;
        };
        (loaded.jwt.is_some() && jwt::looks_like_jwt(password))
            || (loaded.passwords.is_some() && creds.username.is_some())
    }

    fn check(
        &self,
        loaded: &Loaded,
        creds: &Credentials,
        now: SystemTime,
    ) -> Result<Identity, AuthError> {
        if self.sources.tls_identity {
            if let Some(name) = creds.tls_identity {
                let workspace = loaded
                    .passwords
                    .as_ref()
                    .and_then(|p| p.workspace_of(name))
                    .unwrap_or(DEFAULT_WORKSPACE);
                return Ok(Identity {
                    username: Some(Arc::from(name)),
                    workspace: workspace_name(workspace),
                    expires_at: None,
                });
            }
        }
        if let (Some(jwt), Some(password)) = (&loaded.jwt, creds.password) {
            if jwt::looks_like_jwt(password) {
                let token = std::str::from_utf8(password).map_err(|_| AuthError::BadCredentials)?;
                return jwt.verify(token, creds.username, now).map_err(|e| match e {
                    jwt::JwtError::BadWorkspace(_) => {
                        tracing::warn!("auth: client {:?}: JWT refused: {e}", creds.client_id);
                        AuthError::WorkspaceInvalid
                    }
                    e => {
                        tracing::debug!("auth: client {:?}: JWT refused: {e}", creds.client_id);
                        AuthError::BadCredentials
                    }
                });
            }
        }
        if let Some(passwords) = &loaded.passwords {
            if let (Some(user), Some(password)) = (creds.username, creds.password) {
                return match passwords.verify(user, password) {
                    Some(workspace) => Ok(Identity {
                        username: Some(Arc::from(user)),
                        workspace: workspace_name(&workspace),
                        expires_at: None,
                    }),
                    None => Err(AuthError::BadCredentials),
                };
            }
        }
        let presented = creds.username.is_some() || creds.password.is_some();
        let verifiable = loaded.passwords.is_some() || loaded.jwt.is_some();
        match (presented, verifiable, self.sources.anonymous) {
            (false, _, true) => Ok(Identity::anonymous(None)),
            (true, false, true) => Ok(Identity::anonymous(creds.username)),
            (true, true, _) => Err(AuthError::BadCredentials),
            (_, _, false) => Err(AuthError::NotAuthorized),
        }
    }

    /// Re-reads the password file, the ACL file and the JWT keys (on SIGHUP
    /// and when a file changes). Each source that fails keeps its old data
    /// and is logged; the others are replaced.
    ///
    /// # Errors
    ///
    /// The first source that failed, naming its file.
    pub fn reload(&self) -> anyhow::Result<()> {
        let passwords = load_passwords(self.sources.password_file.as_deref());
        let acl = load_acl(self.sources.acl_file.as_deref());
        let jwt = load_jwt(&self.sources.jwt);
        let mut first_error = None;
        let mut loaded = self.loaded.write().unwrap_or_else(|e| e.into_inner());
        let mut keep = |err: anyhow::Error| {
            tracing::warn!(target: "broker", error = %format!("{err:#}"), "reload failed; keeping the previous data");
            first_error.get_or_insert(err);
        };
        match passwords {
            Ok(p) => loaded.passwords = p,
            Err(e) => keep(e),
        }
        match acl {
            Ok(a) => loaded.acl = a,
            Err(e) => keep(e),
        }
        match jwt {
            Ok(j) => loaded.jwt = j,
            Err(e) => keep(e),
        }
        drop(loaded);
        match first_error {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// The ACL in force; `None` when no ACL file is configured, in which
    /// case everything is allowed.
    pub fn acl(&self) -> Option<Arc<Acl>> {
        self.loaded().acl
    }

    /// The failed sign-in guard's series, for [`crate::metrics::Metrics::with_sign_in`].
    pub fn sign_in_metrics(&self) -> &SignInMetrics {
        &self.sign_in_metrics
    }

    /// The files [`Authenticator::reload`] reads (password, ACL, JWKS and
    /// secret files that are configured), for watching them for changes.
    pub fn watched_files(&self) -> Vec<PathBuf> {
        let s = &self.sources;
        let jwt = [&s.jwt.jwks_file, &s.jwt.secret_file]
            .into_iter()
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        s.password_file
            .iter()
            .chain(s.acl_file.iter())
            .cloned()
            .chain(jwt)
            .collect()
    }

    fn loaded(&self) -> Loaded {
        self.loaded
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn load_passwords(path: Option<&Path>) -> anyhow::Result<Option<Arc<PasswordFile>>> {
    path.map(|p| PasswordFile::load(p).map(Arc::new))
        .transpose()
        .context("auth.password_file")
}

fn load_acl(path: Option<&Path>) -> anyhow::Result<Option<Arc<Acl>>> {
    path.map(|p| acl::load(p).map(Arc::new)).transpose()
}

fn load_jwt(settings: &fleetmq_core::settings::Jwt) -> anyhow::Result<Option<Arc<JwtVerifier>>> {
    JwtVerifier::from_settings(settings)
        .map(|v| v.map(Arc::new))
        .context("auth.jwt")
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::time::Duration;

    use super::*;

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Dir {
            let dir =
                std::env::temp_dir().join(format!("fleetmq-auth-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        fn file(&self, name: &str, text: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn creds<'a>(user: Option<&'a str>, password: Option<&'a [u8]>) -> Credentials<'a> {
        Credentials {
            username: user,
            password,
            client_id: "c1",
            peer: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)),
            tls_identity: None,
        }
    }

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    /// Settings with a password file holding `alice` (workspace `acme`).
    fn with_passwords(dir: &Dir) -> Settings {
        let mut s = Settings::default();
        let line = format!("alice:{}:acme\n", password::hash_password("pw"));
        s.auth.password_file = dir.file("passwd", &line);
        s.auth.allow_anonymous = Some(false);
        s
    }

    #[test]
    fn the_authenticator_and_tls_config_can_be_shared_by_shards() {
        fn shared<T: Send + Sync>() {}
        shared::<Authenticator>();
        shared::<crate::tls::TlsConfig>();
    }

    #[test]
    fn anonymous_clients_follow_the_anonymous_rule() {
        let s = Settings::default();
        let auth = Authenticator::from_settings(&s).unwrap();
        let id = auth.authenticate(&creds(None, None), t(0)).unwrap();
        assert_eq!(id, Identity::anonymous(None));
        let id = auth.authenticate(&creds(Some("bob"), None), t(0)).unwrap();
        assert_eq!(
            id.username.as_deref(),
            Some("bob"),
            "nothing to verify against"
        );

        let mut s = Settings::default();
        s.auth.allow_anonymous = Some(false);
        let auth = Authenticator::from_settings(&s).unwrap();
        let err = auth.authenticate(&creds(None, None), t(0)).unwrap_err();
        assert_eq!(
            (err, err.connack_v5(), err.connack_v3()),
            (AuthError::NotAuthorized, 0x87, 5)
        );
    }

    #[test]
    fn password_file_users_sign_in_to_their_workspace() {
        let dir = Dir::new("pw");
        let auth = Authenticator::from_settings(&with_passwords(&dir)).unwrap();
        let id = auth
            .authenticate(&creds(Some("alice"), Some(b"pw")), t(0))
            .unwrap();
        assert_eq!(id.username.as_deref(), Some("alice"));
        assert_eq!(&*id.workspace, "acme");
        let err = auth
            .authenticate(&creds(Some("alice"), Some(b"no")), t(0))
            .unwrap_err();
        assert_eq!(
            (err, err.connack_v5(), err.connack_v3()),
            (AuthError::BadCredentials, 0x86, 4)
        );
        let err = auth
            .authenticate(&creds(Some("alice"), None), t(0))
            .unwrap_err();
        assert_eq!(err, AuthError::BadCredentials);
    }

    #[test]
    fn with_anonymous_allowed_a_password_file_still_verifies_presented_credentials() {
        let dir = Dir::new("pw-anon");
        let mut s = with_passwords(&dir);
        s.auth.allow_anonymous = Some(true);
        let auth = Authenticator::from_settings(&s).unwrap();
        assert!(auth.authenticate(&creds(None, None), t(0)).is_ok());
        let err = auth
            .authenticate(&creds(Some("ops"), None), t(0))
            .unwrap_err();
        assert_eq!(
            err,
            AuthError::BadCredentials,
            "no claiming a user name unverified"
        );
    }

    #[test]
    fn a_tls_identity_signs_in_when_enabled() {
        let dir = Dir::new("tls-id");
        let mut s = with_passwords(&dir);
        s.tls.use_identity_as_username = true;
        let auth = Authenticator::from_settings(&s).unwrap();
        let mut c = creds(None, None);
        c.tls_identity = Some("alice");
        let id = auth.authenticate(&c, t(0)).unwrap();
        assert_eq!(
            (id.username.as_deref(), &*id.workspace),
            (Some("alice"), "acme")
        );
        c.tls_identity = Some("device-7");
        assert_eq!(&*auth.authenticate(&c, t(0)).unwrap().workspace, "default");

        s.tls.use_identity_as_username = false;
        let auth = Authenticator::from_settings(&s).unwrap();
        assert_eq!(auth.authenticate(&c, t(0)), Err(AuthError::NotAuthorized));
    }

    #[test]
    fn a_jwt_password_is_verified_as_a_token_with_its_expiry() {
        use jsonwebtoken::{encode, EncodingKey, Header};
        let dir = Dir::new("jwt");
        let mut s = with_passwords(&dir);
        s.auth.jwt.secret_file = dir.file("secret", "k3y");
        let auth = Authenticator::from_settings(&s).unwrap();
        let exp = 1_700_000_000 + 600;
        let claims = serde_json::json!({ "sub": "dev1", "exp": exp });
        let token = encode(
            &Header::default(),
            &claims,
            &EncodingKey::from_secret(b"k3y"),
        )
        .unwrap();
        let id = auth
            .authenticate(&creds(Some("dev1"), Some(token.as_bytes())), t(0))
            .unwrap();
        assert_eq!(id.expires_at, Some(t(600)));
        let err = auth.authenticate(&creds(Some("dev1"), Some(token.as_bytes())), t(600));
        assert_eq!(err, Err(AuthError::BadCredentials));
        // Ordinary passwords still go to the password file.
        assert!(auth
            .authenticate(&creds(Some("alice"), Some(b"pw")), t(0))
            .is_ok());
    }

    #[test]
    fn repeated_failures_throttle_the_user_name_without_checking_the_password() {
        let dir = Dir::new("throttle");
        let mut s = with_passwords(&dir);
        s.limits.auth_failure_threshold = 3;
        let auth = Authenticator::from_settings(&s).unwrap();
        for i in 0..3 {
            let r = auth.authenticate(&creds(Some("alice"), Some(b"guess")), t(i));
            assert_eq!(r, Err(AuthError::BadCredentials));
        }
        let r = auth.authenticate(&creds(Some("alice"), Some(b"pw")), t(4));
        assert_eq!(r, Err(AuthError::Throttled), "even the right password");
        let mut other = creds(Some("carol"), Some(b"x"));
        other.peer = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7));
        assert_eq!(
            auth.authenticate(&other, t(4)),
            Err(AuthError::BadCredentials)
        );
        let mut alice_elsewhere = creds(Some("alice"), Some(b"pw"));
        alice_elsewhere.peer = other.peer;
        assert_eq!(
            auth.authenticate(&alice_elsewhere, t(4)),
            Err(AuthError::Throttled),
            "per user name, from any address"
        );
        // After the 30 s backoff the right password works again.
        assert!(auth
            .authenticate(&creds(Some("alice"), Some(b"pw")), t(40))
            .is_ok());
    }

    #[test]
    fn the_address_backs_off_only_when_client_addresses_are_trusted() {
        let dir = Dir::new("throttle-address");
        for trust in [false, true] {
            let mut s = with_passwords(&dir);
            s.limits.auth_failure_threshold = 3;
            s.limits.trust_client_addresses = trust;
            let auth = Authenticator::from_settings(&s).unwrap();
            for (i, user) in ["bob", "carol", "dave"].into_iter().enumerate() {
                let r = auth.authenticate(&creds(Some(user), Some(b"guess")), t(i as u64));
                assert_eq!(r, Err(AuthError::BadCredentials));
            }
            let alice = auth.authenticate(&creds(Some("alice"), Some(b"pw")), t(4));
            match alice {
                Ok(id) => assert!(!trust && id.username.as_deref() == Some("alice")),
                Err(e) => assert!(trust && e == AuthError::Throttled, "{e:?}"),
            }
        }
    }

    #[test]
    fn a_device_that_signed_in_is_still_checked_while_its_user_name_backs_off() {
        let dir = Dir::new("throttle-device");
        let mut s = with_passwords(&dir);
        s.limits.auth_failure_threshold = 3;
        let auth = Authenticator::from_settings(&s).unwrap();
        let device = creds(Some("alice"), Some(b"pw"));
        assert!(auth.authenticate(&device, t(0)).is_ok());
        for i in 0..10 {
            let mut guess = creds(Some("alice"), Some(b"guess"));
            guess.peer = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9));
            let client_id = format!("attacker-{i}");
            guess.client_id = &client_id;
            let _ = auth.authenticate(&guess, t(1));
        }
        assert!(auth.authenticate(&device, t(2)).is_ok(), "same client ID");
        let mut fresh = device;
        fresh.client_id = "fresh";
        assert_eq!(auth.authenticate(&fresh, t(2)), Err(AuthError::Throttled));
        let text = crate::metrics::Metrics::with_sign_in(1, auth.sign_in_metrics()).render();
        for line in [
            "fleetmq_auth_backoff_total{decision=\"recognised_checked\"} 1",
            "fleetmq_auth_backoff_total{decision=\"recognised_accepted\"} 1",
            "fleetmq_auth_backoff_total{decision=\"unrecognised_refused\"} 8",
            "fleetmq_auth_throttle_entries{table=\"known_devices\"} 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn a_flood_of_wrong_passwords_for_one_user_name_is_checked_at_the_budget_rate() {
        let dir = Dir::new("throttle-budget");
        let mut s = with_passwords(&dir);
        s.limits.auth_failure_threshold = 1000;
        s.limits.auth_check_rate_per_credential = 2;
        let auth = Authenticator::from_settings(&s).unwrap();
        let results: Vec<_> = (0..5)
            .map(|_| auth.authenticate(&creds(Some("alice"), Some(b"guess")), t(0)))
            .collect();
        assert_eq!(
            results,
            [
                Err(AuthError::BadCredentials),
                Err(AuthError::BadCredentials),
                Err(AuthError::Busy),
                Err(AuthError::Busy),
                Err(AuthError::Busy)
            ]
        );
        let busy = AuthError::Busy;
        assert_eq!((busy.connack_v5(), busy.connack_v3()), (0x89, 3));
        assert!(auth
            .authenticate(&creds(Some("alice"), Some(b"pw")), t(1))
            .is_ok());
    }

    #[test]
    fn a_tls_identity_is_not_throttled() {
        let dir = Dir::new("throttle-tls");
        let mut s = with_passwords(&dir);
        s.limits.auth_failure_threshold = 1;
        s.tls.use_identity_as_username = true;
        let auth = Authenticator::from_settings(&s).unwrap();
        let r = auth.authenticate(&creds(Some("alice"), Some(b"guess")), t(0));
        assert_eq!(r, Err(AuthError::BadCredentials));
        let mut c = creds(Some("alice"), None);
        c.client_id = "new";
        c.tls_identity = Some("alice");
        assert!(
            auth.authenticate(&c, t(1)).is_ok(),
            "proven in the handshake"
        );
    }

    #[test]
    fn reload_picks_up_new_files_and_keeps_the_old_data_on_error() {
        let dir = Dir::new("reload");
        let mut s = with_passwords(&dir);
        s.auth.acl_file = dir.file("acl", "allow any all a/#\n");
        let auth = Authenticator::from_settings(&s).unwrap();
        let acl = auth.acl().unwrap();
        assert!(acl.check(None, "w", "c", acl::Action::Publish, "a/b"));
        assert_eq!(auth.watched_files().len(), 2);

        dir.file("acl", "allow any all b/#\n");
        auth.reload().unwrap();
        let acl = auth.acl().unwrap();
        assert!(!acl.check(None, "w", "c", acl::Action::Publish, "a/b"));

        dir.file("acl", "allow nobody\n");
        dir.file(
            "passwd",
            &format!("bob:{}\n", password::hash_password("pw2")),
        );
        let err = format!("{:#}", auth.reload().unwrap_err());
        assert!(err.contains("ACL file") && err.contains("line 1"), "{err}");
        assert!(
            auth.acl()
                .unwrap()
                .check(None, "w", "c", acl::Action::Publish, "b/c"),
            "old ACL kept"
        );
        assert!(
            auth.authenticate(&creds(Some("bob"), Some(b"pw2")), t(0))
                .is_ok(),
            "passwords reloaded"
        );
    }

    #[test]
    fn a_broken_file_at_start_is_an_error_naming_it() {
        let dir = Dir::new("broken");
        let mut s = Settings::default();
        s.auth.password_file = dir.file("passwd", "alice\n");
        let err = format!("{:#}", Authenticator::from_settings(&s).unwrap_err());
        assert!(err.contains("passwd") && err.contains("line 1"), "{err}");
        assert!(Authenticator::from_settings(&Settings::default())
            .unwrap()
            .acl()
            .is_none());
    }
}
