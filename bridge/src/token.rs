//! The shared secret: compared in constant time, never printed (`Debug` and `Display` show
//! `<redacted>`), so a config or a message in a log line cannot leak it.

use serde::{Deserialize, Serialize};

/// A token clients present in their hello.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    /// Wrap a secret.
    pub fn new(secret: impl Into<String>) -> Token {
        Token(secret.into())
    }

    /// Whether it is empty (an empty token is refused everywhere).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Compare with `other` in time that depends only on the lengths.
    pub fn matches(&self, other: &Token) -> bool {
        crate::protocol::constant_time_eq(self.0.as_bytes(), other.0.as_bytes())
    }

    /// The secret itself, to send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<String> for Token {
    fn from(s: String) -> Token {
        Token(s)
    }
}

impl From<&str> for Token {
    fn from(s: &str) -> Token {
        Token(s.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_printed() {
        let t = Token::from("hunter2-secret");
        assert!(!format!("{t:?} {t} {:?}", Some(&t)).contains("hunter2"));
        assert!(t.matches(&Token::new("hunter2-secret")));
        assert!(!t.matches(&Token::new("hunter2-secreT")));
        assert!(!t.matches(&Token::new("")));
        assert_eq!(serde_json::to_string(&t).unwrap(), "\"hunter2-secret\"");
    }
}
