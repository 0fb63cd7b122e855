//! JSON Web Tokens as MQTT passwords (DESIGN.md §9, `[auth.jwt]` in §15).
//!
//! Accepted: HS256 with the shared secret of `secret_file`, and RS256 /
//! ES256 (P-256) with the public keys of a JWKS file (`{"keys": [...]}`;
//! `oct` keys there give HS256 too). A token names its key by `kid`; a JWKS
//! with a single key uses it for every token. The key decides the
//! algorithm: a token whose header says otherwise is refused (no algorithm
//! confusion).
//!
//! Claims: `exp` is required and the token is refused from that second on;
//! `nbf` is honoured; `iss` and `aud` must match when configured (`aud` may
//! be a string or an array). No clock leeway: the broker's clock decides.
//! The configured `username_claim` (default `sub`) must equal the MQTT user
//! name, or becomes the user name when the client sent none. With
//! `workspace_claim` set, that claim is required and names the workspace.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use fleetmq_core::settings::Jwt as JwtSettings;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use super::password::DEFAULT_WORKSPACE;
use super::Identity;

/// Why a token was refused. All of them end a sign-in with "bad user name
/// or password"; the variants exist for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JwtError {
    /// Not three base64url parts, or a header or payload that is not JSON.
    #[error("malformed token")]
    Malformed,
    /// No configured key for the token's `kid` / algorithm.
    #[error("no key for this token")]
    UnknownKey,
    /// The signature does not verify with the selected key.
    #[error("bad signature")]
    BadSignature,
    /// `exp` is missing or not a number.
    #[error("the token has no exp claim")]
    MissingExpiry,
    /// `exp` has passed.
    #[error("the token has expired")]
    Expired,
    /// `nbf` lies in the future.
    #[error("the token is not valid yet")]
    NotYetValid,
    /// `iss` differs from the configured issuer.
    #[error("wrong issuer")]
    WrongIssuer,
    /// `aud` does not contain the configured audience.
    #[error("wrong audience")]
    WrongAudience,
    /// The user-name claim is missing or differs from the MQTT user name.
    #[error("the user name does not match the token")]
    UsernameMismatch,
    /// The workspace claim is configured but missing or not a string.
    #[error("the token has no workspace claim")]
    MissingWorkspace,
    /// The workspace claim names no workspace fleetmq can keep
    /// ([`fleetmq_core::cluster::names::check_workspace`]: it becomes a
    /// NATS subject token and a stream name); the token itself is good.
    #[error("the token's workspace claim {0}")]
    BadWorkspace(String),
}

#[derive(Clone)]
struct Key {
    kid: Option<String>,
    algorithm: Algorithm,
    key: DecodingKey,
}

/// Verifies JWT passwords against the configured keys and claims.
#[derive(Clone)]
pub struct JwtVerifier {
    secret: Option<DecodingKey>,
    keys: Vec<Key>,
    issuer: Option<String>,
    audience: Option<String>,
    username_claim: String,
    workspace_claim: Option<String>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier")
            .field("secret", &self.secret.is_some())
            .field("jwks_keys", &self.keys.len())
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .finish_non_exhaustive()
    }
}

/// Whether an MQTT password looks like a JWT: three dot-separated base64url
/// parts, the first starting with `eyJ` (`{"` encoded).
pub fn looks_like_jwt(password: &[u8]) -> bool {
    let b64 = |c: &u8| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_';
    password.starts_with(b"eyJ")
        && password.iter().filter(|c| **c == b'.').count() == 2
        && password.iter().all(|c| *c == b'.' || b64(c))
}

impl JwtVerifier {
    /// Loads the keys named by `[auth.jwt]`; `None` when neither
    /// `secret_file` nor `jwks_file` is set.
    ///
    /// # Errors
    ///
    /// A key file that cannot be read, an empty secret, a JWKS that is not
    /// JSON or holds no usable key, or an empty `username_claim`; messages
    /// name the file.
    pub fn from_settings(settings: &JwtSettings) -> anyhow::Result<Option<JwtVerifier>> {
        if !settings.is_configured() {
            return Ok(None);
        }
        if settings.username_claim.is_empty() {
            bail!("auth.jwt.username_claim is empty");
        }
        let secret = match settings.secret_file.as_str() {
            "" => None,
            path => Some(load_secret(Path::new(path))?),
        };
        let keys = match settings.jwks_file.as_str() {
            "" => Vec::new(),
            path => load_jwks(Path::new(path))?,
        };
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        Ok(Some(JwtVerifier {
            secret,
            keys,
            issuer: non_empty(&settings.issuer),
            audience: non_empty(&settings.audience),
            username_claim: settings.username_claim.clone(),
            workspace_claim: non_empty(&settings.workspace_claim),
        }))
    }

    /// Checks `token`'s signature and claims at `now` and returns who it
    /// names, with `expires_at` set to its `exp`.
    ///
    /// # Errors
    ///
    /// The first check that fails, as a [`JwtError`].
    pub fn verify(
        &self,
        token: &str,
        username: Option<&str>,
        now: SystemTime,
    ) -> Result<Identity, JwtError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| JwtError::Malformed)?;
        let (algorithm, key) = self.select(header.alg, header.kid.as_deref())?;
        let mut validation = Validation::new(algorithm);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        let claims = jsonwebtoken::decode::<Value>(token, key, &validation)
            .map_err(|e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::InvalidSignature => JwtError::BadSignature,
                _ => JwtError::Malformed,
            })?
            .claims;
        let expires_at = self.check_claims(&claims, now)?;
        let name = claims
            .get(&self.username_claim)
            .and_then(Value::as_str)
            .ok_or(JwtError::UsernameMismatch)?;
        if username.is_some_and(|u| u != name) || name.is_empty() {
            return Err(JwtError::UsernameMismatch);
        }
        let workspace = match &self.workspace_claim {
            None => DEFAULT_WORKSPACE.to_owned(),
            Some(claim) => claims
                .get(claim)
                .and_then(Value::as_str)
                .filter(|w| !w.is_empty())
                .ok_or(JwtError::MissingWorkspace)?
                .to_owned(),
        };
        fleetmq_core::cluster::names::check_workspace(&workspace)
            .map_err(|e| JwtError::BadWorkspace(format!("{workspace:?} {e}")))?;
        Ok(Identity {
            username: Some(Arc::from(name)),
            workspace: super::workspace_name(&workspace),
            expires_at: Some(expires_at),
        })
    }

    fn select(
        &self,
        alg: Algorithm,
        kid: Option<&str>,
    ) -> Result<(Algorithm, &DecodingKey), JwtError> {
        if alg == Algorithm::HS256 {
            if let Some(secret) = &self.secret {
                return Ok((alg, secret));
            }
        }
        let key = match (kid, self.keys.as_slice()) {
            (_, [only]) => only,
            (Some(kid), keys) => keys
                .iter()
                .find(|k| k.kid.as_deref() == Some(kid))
                .ok_or(JwtError::UnknownKey)?,
            (None, _) => return Err(JwtError::UnknownKey),
        };
        if key.algorithm != alg {
            return Err(JwtError::UnknownKey);
        }
        Ok((alg, &key.key))
    }

    /// Checks `exp`, `nbf`, `iss` and `aud`; returns `exp`.
    fn check_claims(&self, claims: &Value, now: SystemTime) -> Result<SystemTime, JwtError> {
        let time = |name: &str| claims.get(name).and_then(Value::as_f64);
        let at = |secs: f64| {
            let secs = Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX);
            SystemTime::UNIX_EPOCH.checked_add(secs)
        };
        let exp = time("exp").and_then(at).ok_or(JwtError::MissingExpiry)?;
        if now >= exp {
            return Err(JwtError::Expired);
        }
        if let Some(nbf) = time("nbf") {
            if at(nbf).is_none_or(|nbf| now < nbf) {
                return Err(JwtError::NotYetValid);
            }
        }
        if let Some(issuer) = &self.issuer {
            if claims.get("iss").and_then(Value::as_str) != Some(issuer) {
                return Err(JwtError::WrongIssuer);
            }
        }
        if let Some(audience) = &self.audience {
            let ok = match claims.get("aud") {
                Some(Value::String(a)) => a == audience,
                Some(Value::Array(list)) => list.iter().any(|a| a.as_str() == Some(audience)),
                _ => false,
            };
            if !ok {
                return Err(JwtError::WrongAudience);
            }
        }
        Ok(exp)
    }
}

fn load_secret(path: &Path) -> anyhow::Result<DecodingKey> {
    let mut bytes =
        std::fs::read(path).with_context(|| format!("JWT secret file {}", path.display()))?;
    while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        bytes.pop();
    }
    if bytes.is_empty() {
        bail!("JWT secret file {}: the secret is empty", path.display());
    }
    Ok(DecodingKey::from_secret(&bytes))
}

fn load_jwks(path: &Path) -> anyhow::Result<Vec<Key>> {
    let ctx = || format!("JWKS file {}", path.display());
    let text = std::fs::read_to_string(path).with_context(ctx)?;
    let value: Value = serde_json::from_str(&text).with_context(ctx)?;
    let Some(entries) = value.get("keys").and_then(Value::as_array) else {
        bail!("{}: expected an object with a \"keys\" array", ctx());
    };
    let mut keys = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        match key_from_jwk(entry) {
            Ok(key) => keys.push(key),
            Err(e) => tracing::warn!("auth: {}: key {i} skipped: {e:#}", ctx()),
        }
    }
    if keys.is_empty() {
        bail!(
            "{}: no usable key (RS256, ES256 on P-256, or oct for HS256)",
            ctx()
        );
    }
    Ok(keys)
}

fn key_from_jwk(entry: &Value) -> anyhow::Result<Key> {
    let jwk: Jwk = serde_json::from_value(entry.clone()).context("not a JWK")?;
    if jwk.common.public_key_use == Some(jsonwebtoken::jwk::PublicKeyUse::Encryption) {
        bail!("an encryption key (\"use\": \"enc\")");
    }
    let algorithm = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => Algorithm::ES256,
        AlgorithmParameters::OctetKey(_) => Algorithm::HS256,
        _ => bail!("unsupported key type or curve"),
    };
    if let Some(declared) = jwk.common.key_algorithm {
        if declared.to_string() != format!("{algorithm:?}") {
            bail!("\"alg\": {declared} (only {algorithm:?} for this key type)");
        }
    }
    let key = DecodingKey::from_jwk(&jwk).context("bad key parameters")?;
    Ok(Key {
        kid: jwk.common.key_id.clone(),
        algorithm,
        key,
    })
}

#[cfg(test)]
mod tests {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    use super::*;

    const NOW: u64 = 1_800_000_000;

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(NOW)
    }

    struct Fixture {
        dir: std::path::PathBuf,
        settings: JwtSettings,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let dir =
                std::env::temp_dir().join(format!("fleetmq-jwt-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Fixture {
                dir,
                settings: JwtSettings::default(),
            }
        }

        fn secret(mut self, secret: &str) -> Self {
            let path = self.dir.join("secret");
            std::fs::write(&path, format!("{secret}\n")).unwrap();
            self.settings.secret_file = path.display().to_string();
            self
        }

        fn jwks(mut self, keys: Value) -> Self {
            let path = self.dir.join("jwks.json");
            std::fs::write(&path, json!({ "keys": keys }).to_string()).unwrap();
            self.settings.jwks_file = path.display().to_string();
            self
        }

        fn verifier(&self) -> JwtVerifier {
            JwtVerifier::from_settings(&self.settings).unwrap().unwrap()
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn hs256(secret: &str, claims: Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    /// An ES256 key pair: the encoding key and its public JWK.
    fn es256_key(kid: &str) -> (EncodingKey, Value) {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let encoding = EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).unwrap();
        let raw = pair.public_key_raw();
        assert_eq!(raw.len(), 65, "uncompressed point");
        let jwk = json!({
            "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
            "x": URL_SAFE_NO_PAD.encode(&raw[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&raw[33..]),
        });
        (encoding, jwk)
    }

    fn es256(key: &EncodingKey, kid: Option<&str>, claims: Value) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = kid.map(str::to_owned);
        encode(&header, &claims, key).unwrap()
    }

    fn claims(sub: &str, exp: u64) -> Value {
        json!({ "sub": sub, "exp": exp })
    }

    #[test]
    fn a_valid_hs256_token_signs_in_its_subject_until_exp() {
        let f = Fixture::new("hs-valid").secret("s3cret");
        let v = f.verifier();
        let token = hs256("s3cret", claims("dev1", NOW + 60));
        assert!(looks_like_jwt(token.as_bytes()));
        let id = v.verify(&token, Some("dev1"), now()).unwrap();
        assert_eq!(id.username.as_deref(), Some("dev1"));
        assert_eq!(&*id.workspace, "default");
        assert_eq!(
            id.expires_at,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(NOW + 60))
        );
        let id = v.verify(&token, None, now()).unwrap();
        assert_eq!(
            id.username.as_deref(),
            Some("dev1"),
            "no user name: the claim's"
        );
    }

    #[test]
    fn an_expired_or_not_yet_valid_token_is_refused() {
        let f = Fixture::new("hs-exp").secret("s3cret");
        let v = f.verifier();
        let expired = hs256("s3cret", claims("dev1", NOW));
        assert_eq!(v.verify(&expired, None, now()), Err(JwtError::Expired));
        let no_exp = hs256("s3cret", json!({ "sub": "dev1" }));
        assert_eq!(v.verify(&no_exp, None, now()), Err(JwtError::MissingExpiry));
        let early = hs256(
            "s3cret",
            json!({ "sub": "d", "exp": NOW + 60, "nbf": NOW + 1 }),
        );
        assert_eq!(v.verify(&early, None, now()), Err(JwtError::NotYetValid));
        let ready = hs256("s3cret", json!({ "sub": "d", "exp": NOW + 60, "nbf": NOW }));
        assert!(v.verify(&ready, None, now()).is_ok());
    }

    #[test]
    fn a_token_signed_with_another_key_is_refused() {
        let f = Fixture::new("hs-wrong").secret("s3cret");
        let token = hs256("other", claims("dev1", NOW + 60));
        assert_eq!(
            f.verifier().verify(&token, None, now()),
            Err(JwtError::BadSignature)
        );
    }

    #[test]
    fn issuer_and_audience_are_checked_when_configured() {
        let mut f = Fixture::new("iss-aud").secret("s3cret");
        f.settings.issuer = "https://id.example".into();
        f.settings.audience = "fleet".into();
        let v = f.verifier();
        let good = json!({ "sub": "d", "exp": NOW + 60, "iss": "https://id.example", "aud": ["x", "fleet"] });
        assert!(v.verify(&hs256("s3cret", good), None, now()).is_ok());
        let wrong_aud =
            json!({ "sub": "d", "exp": NOW + 60, "iss": "https://id.example", "aud": "other" });
        assert_eq!(
            v.verify(&hs256("s3cret", wrong_aud), None, now()),
            Err(JwtError::WrongAudience)
        );
        let wrong_iss =
            json!({ "sub": "d", "exp": NOW + 60, "iss": "https://evil", "aud": "fleet" });
        assert_eq!(
            v.verify(&hs256("s3cret", wrong_iss), None, now()),
            Err(JwtError::WrongIssuer)
        );
        let no_aud = json!({ "sub": "d", "exp": NOW + 60, "iss": "https://id.example" });
        assert_eq!(
            v.verify(&hs256("s3cret", no_aud), None, now()),
            Err(JwtError::WrongAudience)
        );
    }

    #[test]
    fn the_user_name_must_equal_the_configured_claim() {
        let mut f = Fixture::new("claim").secret("s3cret");
        let token = hs256(
            "s3cret",
            json!({ "sub": "dev1", "device": "dev2", "exp": NOW + 60 }),
        );
        assert_eq!(
            f.verifier().verify(&token, Some("dev2"), now()),
            Err(JwtError::UsernameMismatch)
        );
        f.settings.username_claim = "device".into();
        let id = f.verifier().verify(&token, Some("dev2"), now()).unwrap();
        assert_eq!(id.username.as_deref(), Some("dev2"));
    }

    #[test]
    fn the_workspace_comes_from_the_configured_claim_which_is_then_required() {
        let mut f = Fixture::new("ws").secret("s3cret");
        f.settings.workspace_claim = "tenant".into();
        let v = f.verifier();
        let token = hs256(
            "s3cret",
            json!({ "sub": "d", "tenant": "acme", "exp": NOW + 60 }),
        );
        assert_eq!(&*v.verify(&token, None, now()).unwrap().workspace, "acme");
        let token = hs256("s3cret", claims("d", NOW + 60));
        assert_eq!(
            v.verify(&token, None, now()),
            Err(JwtError::MissingWorkspace)
        );
        // A claim that cannot be a workspace (a NATS subject token, a
        // stream name) is refused naming the rule, though well signed.
        for bad in ["acme.north", "a b", &"w".repeat(65)] {
            let token = hs256("s3cret", json!({ "sub": "d", "tenant": bad, "exp": NOW + 60 }));
            match v.verify(&token, None, now()) {
                Err(JwtError::BadWorkspace(why)) => assert!(why.contains(&format!("{bad:?}")), "{why}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn es256_keys_come_from_a_jwks_and_are_selected_by_kid() {
        let (k1, jwk1) = es256_key("k1");
        let (k2, jwk2) = es256_key("k2");
        let f = Fixture::new("es").jwks(json!([jwk1, jwk2]));
        let v = f.verifier();
        let by_k1 = es256(&k1, Some("k1"), claims("dev1", NOW + 60));
        assert_eq!(
            v.verify(&by_k1, Some("dev1"), now())
                .unwrap()
                .username
                .as_deref(),
            Some("dev1")
        );
        let by_k2 = es256(&k2, Some("k2"), claims("dev1", NOW + 60));
        assert!(v.verify(&by_k2, None, now()).is_ok());
        let lying = es256(&k2, Some("k1"), claims("dev1", NOW + 60));
        assert_eq!(v.verify(&lying, None, now()), Err(JwtError::BadSignature));
        let unknown = es256(&k1, Some("k9"), claims("dev1", NOW + 60));
        assert_eq!(v.verify(&unknown, None, now()), Err(JwtError::UnknownKey));
        let no_kid = es256(&k1, None, claims("dev1", NOW + 60));
        assert_eq!(v.verify(&no_kid, None, now()), Err(JwtError::UnknownKey));
    }

    #[test]
    fn a_single_jwks_key_is_used_without_a_kid_and_fixes_the_algorithm() {
        let (k1, jwk1) = es256_key("k1");
        let (other, _) = es256_key("k2");
        let f = Fixture::new("es-one").jwks(json!([jwk1]));
        let v = f.verifier();
        assert!(v
            .verify(&es256(&k1, None, claims("d", NOW + 60)), None, now())
            .is_ok());
        let wrong = es256(&other, None, claims("d", NOW + 60));
        assert_eq!(v.verify(&wrong, None, now()), Err(JwtError::BadSignature));
        // An HS256 token cannot borrow the public key as an HMAC secret.
        let confused = hs256("whatever", claims("d", NOW + 60));
        assert_eq!(v.verify(&confused, None, now()), Err(JwtError::UnknownKey));
    }

    #[test]
    fn key_files_that_are_missing_or_unusable_are_named_in_the_error() {
        let mut f = Fixture::new("bad");
        f.settings.jwks_file = f.dir.join("nope.json").display().to_string();
        let err = format!("{:#}", JwtVerifier::from_settings(&f.settings).unwrap_err());
        assert!(err.contains("nope.json"), "{err}");
        let f = Fixture::new("bad2")
            .jwks(json!([{ "kty": "EC", "crv": "P-521", "x": "AA", "y": "AA" }]));
        let err = format!("{:#}", JwtVerifier::from_settings(&f.settings).unwrap_err());
        assert!(err.contains("no usable key"), "{err}");
        let f = Fixture::new("bad3").secret("");
        let err = format!("{:#}", JwtVerifier::from_settings(&f.settings).unwrap_err());
        assert!(err.contains("empty"), "{err}");
        assert!(JwtVerifier::from_settings(&JwtSettings::default())
            .unwrap()
            .is_none());
    }

    #[test]
    fn only_jwt_shaped_passwords_look_like_jwts() {
        assert!(looks_like_jwt(b"eyJhbGciOi.eyJzdWIi.sig-_x"));
        assert!(!looks_like_jwt(b"hunter2"));
        assert!(!looks_like_jwt(b"eyJ.a"));
        assert!(!looks_like_jwt(b"eyJ.a.b c"));
    }
}
