//! How a binary prints the error that ends it: one line, each cause once.
//! Many errors name their cause in their own message *and* return it as
//! their `source()` (so a caller can match on it); printing the whole chain
//! would then say `secret file X: ... : secret file X: ...`. No backtrace
//! either, whatever `RUST_BACKTRACE` says: these are an operator's errors
//! (a missing file, a port in use), not bugs.

use std::error::Error;

/// The messages of `chain` (an error, then its causes) joined by `": "`,
/// leaving out a cause whose message the line already holds.
pub fn one_line<'a>(chain: impl IntoIterator<Item = &'a (dyn Error + 'static)>) -> String {
    let mut out = String::new();
    for cause in chain {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("secret file /k: {0}")]
    struct Secret(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("volume \"a\"")]
    struct Volume(#[source] Secret);

    #[test]
    fn each_cause_is_said_once() {
        let e = Volume(Secret(std::io::Error::from(std::io::ErrorKind::NotFound)));
        let top: &(dyn Error + 'static) = &e;
        let chain = std::iter::successors(Some(top), |c: &&(dyn Error + 'static)| (*c).source());
        assert_eq!(
            one_line(chain),
            "volume \"a\": secret file /k: entity not found"
        );
    }
}
