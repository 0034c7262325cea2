//! The shared secret: compared in constant time, never printed (`Debug` and `Display` show
//! `<redacted>`), so a config or a message in a log line cannot leak it. A server may hold
//! several, each with a [`Scope`]: every region, or some regions, each for reading or for
//! reading and writing ([`parse_grants`] reads them from a token file).

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

/// What a token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every region, with the access the region allows.
    All,
    /// These regions only: (name, writes allowed).
    Regions(Vec<(String, bool)>),
}

impl Scope {
    /// Whether the holder may see (list, open for reading) region `name`.
    pub fn sees(&self, name: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Regions(r) => r.iter().any(|(n, _)| n == name),
        }
    }

    /// Whether the holder may open region `name` (for writing, if `write`).
    pub fn allows(&self, name: &str, write: bool) -> bool {
        match self {
            Scope::All => true,
            Scope::Regions(r) => r.iter().any(|(n, w)| n == name && (*w || !write)),
        }
    }
}

/// A token and what it grants.
#[derive(Debug, Clone)]
pub struct Grant {
    /// The secret.
    pub token: Token,
    /// What it grants.
    pub scope: Scope,
}

impl Grant {
    /// A token that grants everything.
    pub fn all(token: impl Into<Token>) -> Grant {
        Grant {
            token: token.into(),
            scope: Scope::All,
        }
    }
}

/// The scope of the first grant whose token is `presented`. Every grant is compared (each in
/// constant time), so the time taken says nothing about which one matched.
pub fn find_grant(grants: &[Grant], presented: &Token) -> Option<Scope> {
    let mut found = None;
    for g in grants {
        if g.token.matches(presented) && found.is_none() {
            found = Some(g.scope.clone());
        }
    }
    found
}

/// Read a server's token file: one grant per line, `SECRET` (every region) or
/// `SECRET REGION[:ro|:rw]...` (those regions only; `:ro`, the default, for reading); blank
/// lines and lines starting with `#` are skipped. Errors name the line.
pub fn parse_grants(text: &str) -> Result<Vec<Grant>, String> {
    let mut out: Vec<Grant> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let secret = words.next().expect("a non-empty line has a word");
        let mut regions = Vec::new();
        for w in words {
            let (name, write) = match w.rsplit_once(':') {
                Some((n, "rw")) => (n, true),
                Some((n, "ro")) => (n, false),
                Some((_, other)) => {
                    return Err(format!(
                        "line {}: '{w}': the access after ':' is ro or rw, not '{other}'",
                        i + 1
                    ))
                }
                None => (w, false),
            };
            if name.is_empty() {
                return Err(format!("line {}: '{w}': a region name is missing", i + 1));
            }
            regions.push((name.to_string(), write));
        }
        let token = Token::new(secret);
        if out.iter().any(|g| g.token.matches(&token)) {
            return Err(format!(
                "line {}: the same secret is given twice (each secret has one scope)",
                i + 1
            ));
        }
        out.push(Grant {
            token,
            scope: if regions.is_empty() {
                Scope::All
            } else {
                Scope::Regions(regions)
            },
        });
    }
    if out.is_empty() {
        return Err("no token in it (one secret per line)".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files_hold_scoped_grants() {
        let g =
            parse_grants("# admin\nadmin-secret\n\nreader img logs:ro\nwriter scratch:rw img\n")
                .unwrap();
        assert_eq!(g.len(), 3);
        assert_eq!(g[0].scope, Scope::All);
        let scope = |t: &str| find_grant(&g, &Token::new(t));
        let r = scope("reader").unwrap();
        assert!(r.sees("img") && r.allows("img", false) && !r.allows("img", true));
        assert!(!r.sees("scratch") && !r.allows("scratch", false));
        let w = scope("writer").unwrap();
        assert!(w.allows("scratch", true) && w.allows("img", false) && !w.allows("img", true));
        assert!(scope("nobody").is_none());
        assert!(!format!("{g:?}").contains("secret"), "{g:?}");
        for (bad, why) in [
            ("a b:rx", "ro or rw"),
            ("a :rw", "region name is missing"),
            ("a\na b", "given twice"),
            ("# only a comment\n", "no token"),
        ] {
            let e = parse_grants(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

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
