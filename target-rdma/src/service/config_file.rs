//! What `arenad.toml` and `ublkd.toml` share: reading a TOML file into a
//! schema, and the errors that stop startup naming the file, the key, the
//! value and what is allowed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

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
    #[error("invalid config {}{}: {}{message}", path.display(), at.map(|(l, c)| format!(":{l}:{c}")).unwrap_or_default(), key.as_ref().map(|k| format!("{k}: ")).unwrap_or_default())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Line and column (from 1) of the offending text, when known.
        at: Option<(usize, usize)>,
        /// The dotted key there (`metrics.per_device_labels`,
        /// `volume[1].quota`), when one could be found.
        key: Option<String>,
        /// The parser's message.
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
    toml::from_str(text).map_err(|e| {
        let at = e.span().map(|s| s.start.min(text.len()));
        ConfigError::Parse {
            path: path.to_owned(),
            at: at.map(|o| line_column(text, o)),
            key: at.and_then(|o| key_at(text, o)),
            message: e.message().trim_end().to_owned(),
        }
    })
}

/// Line and column, both from 1, of byte `offset` of `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..text.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// The dotted key the text at `offset` belongs to: the key of its
/// `key = value` line (or of the nearest one above, for a value spanning
/// lines) under the table header above it; `[[name]]` tables are numbered
/// as validation names them (`volume[0]`). The TOML parser knows the key
/// but does not expose it, and the files these daemons read are one key
/// per line.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let line_no = text[..text.floor_char_boundary(offset)]
        .matches('\n')
        .count();
    let lines: Vec<&str> = text.lines().collect();
    let header = |l: &str| -> Option<(String, bool)> {
        let l = l.trim();
        if let Some(name) = l.strip_prefix("[[").and_then(|r| r.split("]]").next()) {
            return Some((name.trim().to_owned(), true));
        }
        let name = l.strip_prefix('[')?.split(']').next()?;
        Some((name.trim().to_owned(), false))
    };
    let key_of = |l: &str| -> Option<String> {
        let (k, _) = l.split_once('=')?;
        let k = k.trim().trim_matches('"');
        (!k.is_empty() && !k.starts_with('#')).then(|| k.to_owned())
    };
    let mut key = None;
    let mut table_line = None;
    for i in (0..=line_no.min(lines.len().saturating_sub(1))).rev() {
        if header(lines[i]).is_some() {
            table_line = Some(i);
            break;
        }
        if key.is_none() {
            key = key_of(lines[i]);
        }
    }
    let table = table_line.and_then(|t| {
        let (name, array) = header(lines[t])?;
        if !array {
            return Some(name);
        }
        let index = lines[..t]
            .iter()
            .filter(|l| header(l).is_some_and(|(n, a)| a && n == name))
            .count();
        Some(format!("{name}[{index}]"))
    });
    match (table, key) {
        (Some(t), Some(k)) => Some(format!("{t}.{k}")),
        (t, k) => k.or(t),
    }
}

/// Every leaf of a config as `dotted.key -> value` (TOML spelling; arrays
/// of tables as `name[i].key`), so two configs compare key by key.
pub fn flatten<T: Serialize>(cfg: &T) -> BTreeMap<String, String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        let join = |k: &str| {
            if prefix.is_empty() {
                k.to_owned()
            } else {
                format!("{prefix}.{k}")
            }
        };
        match v {
            toml::Value::Table(t) => t.iter().for_each(|(k, v)| walk(&join(k), v, out)),
            toml::Value::Array(a) if a.iter().all(toml::Value::is_table) && !a.is_empty() => a
                .iter()
                .enumerate()
                .for_each(|(i, v)| walk(&format!("{prefix}[{i}]"), v, out)),
            toml::Value::String(s) => {
                out.insert(prefix.to_owned(), s.clone());
            }
            other => {
                out.insert(prefix.to_owned(), other.to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    if let Ok(v) = toml::Value::try_from(cfg) {
        walk("", &v, &mut out);
    }
    out
}

/// One key whose value differs between two configs (`None`: unset); as
/// such also in the reload answers of ublkctl's and arenactl's protocols.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Dotted key.
    pub key: String,
    /// Value in force before.
    pub old: Option<String>,
    /// Value in the new config.
    pub new: Option<String>,
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(unset)".into());
        write!(
            f,
            "{}: {} -> {}",
            self.key,
            show(&self.old),
            show(&self.new)
        )
    }
}

/// The keys whose values differ between `old` and `new`, in key order.
pub fn changes<T: Serialize>(old: &T, new: &T) -> Vec<Change> {
    let (a, b) = (flatten(old), flatten(new));
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| Change {
            key: k.clone(),
            old: a.get(k).cloned(),
            new: b.get(k).cloned(),
        })
        .collect()
}

/// Logs a reload's changed keys: each in force now as `config.changed`,
/// each that waits for a restart of `service` as `config.restart_needed`.
/// One function, so that ublkd's and arenad's reloads log the same events.
pub fn log_changes(applied: &[Change], restart_needed: &[Change], service: &str) {
    for c in applied {
        let (old, new) = (c.old.as_deref(), c.new.as_deref());
        tracing::info!(event = ublk_metrics::events::CONFIG_CHANGED, key = %c.key, old = old.unwrap_or("(unset)"), new = new.unwrap_or("(unset)"));
    }
    for c in restart_needed {
        let (old, new) = (c.old.as_deref(), c.new.as_deref());
        tracing::warn!(event = ublk_metrics::events::CONFIG_RESTART_NEEDED, key = %c.key, old = old.unwrap_or("(unset)"), new = new.unwrap_or("(unset)"), "takes effect after `systemctl restart {service}`");
    }
}

/// The effective configuration as TOML (sizes in human units), for
/// `--check-config` / `--check`.
pub fn render<T: Serialize>(cfg: &T) -> String {
    toml::to_string(cfg).unwrap_or_else(|e| format!("# cannot render the configuration: {e}\n"))
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
            e.starts_with("invalid config /etc/x.toml:2:1: colour: unknown field `colour`"),
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

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Nested {
        top: Option<u32>,
        metrics: Option<Inner>,
        volume: Option<Vec<Inner>>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        on: Option<bool>,
        size: Option<u64>,
    }

    #[test]
    fn wrong_types_name_the_dotted_key_with_line_and_column() {
        let p = Path::new("/etc/x.toml");
        let e = |text: &str| parse_toml::<Nested>(text, p).unwrap_err().to_string();
        assert_eq!(
            e("top = 1\n[metrics]\non = \"yes\"\n"),
            "invalid config /etc/x.toml:3:6: metrics.on: invalid type: string \"yes\", expected a boolean"
        );
        assert_eq!(
            e("top = \"x\"\n"),
            "invalid config /etc/x.toml:1:7: top: invalid type: string \"x\", expected u32"
        );
        let text = "[[volume]]\nsize = 1\n\n[[volume]]\n# note\nsize = -1\n";
        assert!(
            e(text).starts_with(
                "invalid config /etc/x.toml:6:8: volume[1].size: invalid value: integer `-1`"
            ),
            "{}",
            e(text)
        );
        assert!(e("top = ").starts_with("invalid config /etc/x.toml:1:7: top: "));
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
