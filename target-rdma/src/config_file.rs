//! What `arenad.toml` and `ublkd.toml` share: reading a TOML file into a
//! schema, and the errors that stop startup naming the file, the key, the
//! value and what is allowed.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

/// A config that could not be loaded or failed validation.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// TOML syntax, an unknown key, or a value of the wrong type.
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, which names the key and where it is.
        message: String,
    },
    /// A value outside its allowed range.
    #[error("invalid config: {key} = {value}: {reason}")]
    Invalid {
        /// Dotted key name, e.g. `device.depth` or `volume[0].quota`.
        key: String,
        /// The value as given.
        value: String,
        /// What is allowed.
        reason: String,
    },
}

/// The `Invalid` error for `key = value`.
pub fn invalid(
    key: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Reads `path` and parses it as `T` (not validated).
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_toml(&text, path)
}

/// Parses `text` as `T`; `path` only labels errors.
pub fn parse_toml<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: e.message().to_owned()
            + &e.span()
                .map(|s| format!(" (at byte {})", s.start))
                .unwrap_or_default(),
    })
}

/// A listener setting: `""` or `"off"` disables it, anything else must be an
/// `IP:port`, checked as `key`.
pub fn listen_setting<'a>(
    key: &str,
    value: &'a str,
    example: &str,
) -> Result<Option<&'a str>, ConfigError> {
    match value {
        "" | "off" => Ok(None),
        a if a.parse::<std::net::SocketAddr>().is_ok() => Ok(Some(a)),
        a => Err(invalid(
            key,
            format!("{a:?}"),
            format!("must be IP:port (e.g. \"{example}\"), or \"off\" to disable the listener"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Schema {
        #[allow(dead_code)]
        depth: u32,
    }

    #[test]
    fn errors_name_the_file_the_key_and_the_value() {
        let p = Path::new("/etc/x.toml");
        let e = parse_toml::<Schema>("depth = 1\ncolour = 2\n", p)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("invalid config /etc/x.toml: ") && e.contains("unknown field `colour`"),
            "{e}"
        );
        let e = load_toml::<Schema>(Path::new("/nonexistent/x.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot read config /nonexistent/x.toml: "),
            "{e}"
        );
        assert_eq!(
            invalid("device.depth", 0, "must be between 1 and 4096").to_string(),
            "invalid config: device.depth = 0: must be between 1 and 4096"
        );
    }

    #[test]
    fn listeners_can_be_turned_off() {
        assert_eq!(listen_setting("k", "off", "127.0.0.1:1").unwrap(), None);
        assert_eq!(listen_setting("k", "", "127.0.0.1:1").unwrap(), None);
        assert_eq!(
            listen_setting("k", "127.0.0.1:9", "127.0.0.1:1").unwrap(),
            Some("127.0.0.1:9")
        );
        let e = listen_setting("metrics.listen", "localhost:9477", "127.0.0.1:9477")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "invalid config: metrics.listen = \"localhost:9477\": must be IP:port (e.g. \"127.0.0.1:9477\"), or \"off\" to disable the listener");
    }
}
