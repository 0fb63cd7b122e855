//! The token that stands for a name (a client identifier, a topic, a
//! topic filter) in a KV key: the name's UTF-8 bytes in base64url without
//! padding while that is at most [`MAX_PLAIN_TOKEN`] characters, else
//! `=` and the base64url of the name's SHA-256 ([`HASHED_TOKEN_LEN`]
//! characters). The empty name is `=` (a key may not end with a dot).
//!
//! Why a bound: every KV key travels in a NATS subject (`$KV.<bucket>.<key>`,
//! and `$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>` for a read),
//! and a protocol line with its subject and reply inbox longer than the
//! server's `max_control_line` (4 KiB by default) ends the whole
//! connection with `maximum control line exceeded`. nats-server checks no
//! other subject length (`isValidSubject`). With a token of at most
//! [`MAX_PLAIN_TOKEN`] characters, the longest key (a route key: a
//! replica ID of at most 253 bytes, a dot, the token) is 1,278 bytes and
//! the longest subject built from it (a direct get on the longest bucket
//! name, 66 bytes of prefix) 1,344: with the longest inbox async-nats
//! makes and the lengths, a protocol line stays under 1,500 bytes, a
//! third of the limit.
//!
//! A hashed token never equals a plain one: base64url has no `=`, and the
//! only plain token that starts with `=` is `=` alone. A name whose key is
//! hashed cannot be read back from the key: every record stored under such
//! a key carries its name (`client_id`, `topic`, `filter`), and a reader
//! checks that the record's name makes the key it was found under.
//! Names up to `MAX_PLAIN_TOKEN * 3 / 4` (768) bytes keep the key they
//! always had, so stored data stays readable.

use base64::Engine as _;
use sha2::Digest as _;

const B64URL: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// Longest token written as the name itself (base64url characters):
/// names of at most 768 bytes.
pub const MAX_PLAIN_TOKEN: usize = 1024;

/// The length of a hashed token: `=` and 43 base64url characters.
pub const HASHED_TOKEN_LEN: usize = 44;

/// The token of the empty name.
const EMPTY: &str = "=";

/// The token of `name` in a KV key (see the module's doc).
pub fn name_token(name: &str) -> String {
    if name.is_empty() {
        return EMPTY.to_owned();
    }
    if base64::encoded_len(name.len(), false).is_some_and(|n| n <= MAX_PLAIN_TOKEN) {
        return B64URL.encode(name);
    }
    format!("={}", B64URL.encode(sha2::Sha256::digest(name.as_bytes())))
}

/// What a token says of its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Token {
    /// The name itself.
    Plain(String),
    /// A hash of a long name: the name is in the record stored under the
    /// key.
    Hashed,
}

/// Read a token made by [`name_token`]; `None` for one it cannot have
/// made (bad base64, not UTF-8, a plain token longer than
/// [`MAX_PLAIN_TOKEN`], a malformed hash).
pub fn read_token(token: &str) -> Option<Token> {
    if token == EMPTY {
        return Some(Token::Plain(String::new()));
    }
    if let Some(hash) = token.strip_prefix('=') {
        let hashed = hash.len() == HASHED_TOKEN_LEN - 1 && B64URL.decode(hash).is_ok_and(|h| h.len() == 32);
        return hashed.then_some(Token::Hashed);
    }
    if token.len() > MAX_PLAIN_TOKEN {
        return None;
    }
    let bytes = B64URL.decode(token).ok()?;
    String::from_utf8(bytes).ok().map(Token::Plain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key_alphabet(token: &str) -> bool {
        token.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=".contains(&b))
    }

    #[test]
    fn a_name_up_to_768_bytes_is_written_as_it_is_and_a_longer_one_hashed() {
        let at_bound = "x".repeat(768);
        assert_eq!(name_token(&at_bound).len(), MAX_PLAIN_TOKEN);
        assert_eq!(read_token(&name_token(&at_bound)), Some(Token::Plain(at_bound.clone())));
        let over = "x".repeat(769);
        let hashed = name_token(&over);
        assert_eq!(hashed.len(), HASHED_TOKEN_LEN);
        assert!(hashed.starts_with('=') && key_alphabet(&hashed));
        assert_eq!(read_token(&hashed), Some(Token::Hashed));
        assert_eq!(name_token(&"x".repeat(65_535)).len(), HASHED_TOKEN_LEN);
        // As before the bound existed (stored data stays readable).
        assert_eq!(name_token("dev/1"), "ZGV2LzE");
        assert_eq!(name_token(""), "=");
        assert_eq!(read_token("="), Some(Token::Plain(String::new())));
    }

    #[test]
    fn a_token_no_name_makes_is_refused() {
        assert_eq!(read_token("!!"), None);
        assert_eq!(read_token("=abc"), None, "too short for a hash");
        assert_eq!(read_token(&format!("={}", "A".repeat(43))), Some(Token::Hashed));
        assert_eq!(read_token(&"A".repeat(MAX_PLAIN_TOKEN + 4)), None, "a plain token over the bound");
        assert_eq!(read_token("_w"), None, "not UTF-8");
    }

    proptest! {
        #[test]
        fn any_name_round_trips_or_is_hashed_past_the_bound(name in "\\PC{0,400}", repeat in 1usize..12) {
            let name = name.repeat(repeat);
            let token = name_token(&name);
            prop_assert!(key_alphabet(&token) && !token.is_empty());
            prop_assert!(token.len() <= MAX_PLAIN_TOKEN);
            match read_token(&token) {
                Some(Token::Plain(back)) => prop_assert_eq!(back, name),
                Some(Token::Hashed) => prop_assert!(name.len() > MAX_PLAIN_TOKEN * 3 / 4),
                None => prop_assert!(false, "unreadable token {token}"),
            }
        }

        #[test]
        fn a_hashed_token_never_equals_a_plain_one(long in "\\PC{769,900}", short in "\\PC{0,200}") {
            let (hashed, plain) = (name_token(&long), name_token(&short));
            prop_assert_eq!(read_token(&hashed), Some(Token::Hashed));
            prop_assert_ne!(hashed, plain);
        }
    }
}
