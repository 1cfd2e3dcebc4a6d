//! Human byte sizes (`64G`, `1M`, `4096`) for configs and command lines.
//!
//! Units are binary (K = 1024) because block sizes, blob sizes and arena
//! sizes are all powers of two; an operator writing `1G` means 2^30.

use std::fmt;

/// Why a size string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (examples: 4096, 4K, 1M, 64G, 2T)")]
pub struct SizeError {
    input: String,
    reason: &'static str,
}

/// Parses `N[K|M|G|T][i][B]`, case-insensitive, into bytes.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: input.to_owned(),
        reason,
    };
    let s = input.trim();
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if digits_end == 0 {
        return Err(err("must start with a number"));
    }
    let n: u64 = s[..digits_end]
        .parse()
        .map_err(|_| err("number too large"))?;
    let unit = s[digits_end..].trim().to_ascii_uppercase();
    let unit = unit.strip_suffix('B').unwrap_or(&unit);
    let unit = unit.strip_suffix('I').unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(err("unknown unit")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| err("overflows 64 bits"))
}

/// Formats bytes in the largest binary unit that divides them exactly.
pub struct HumanSize(pub u64);

impl fmt::Display for HumanSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut n = self.0;
        for unit in ["", "K", "M", "G", "T"] {
            if n < 1024 || !n.is_multiple_of(1024) || unit == "T" {
                return write!(f, "{n}{unit}");
            }
            n /= 1024;
        }
        unreachable!("the loop returns at T")
    }
}

/// Formats bytes for reading, not parsing: exact like [`HumanSize`] when a
/// unit divides them, else one decimal in the largest unit below them
/// (`64.1M`, `14.9G`).
pub struct ApproxSize(pub u64);

impl fmt::Display for ApproxSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        if n < 1024 || n.is_multiple_of(1024 * 1024) {
            return HumanSize(n).fmt(f);
        }
        let (mut value, mut unit) = (n as f64 / 1024.0, "K");
        for next in ["M", "G", "T"] {
            if value < 1024.0 {
                break;
            }
            value /= 1024.0;
            unit = next;
        }
        write!(f, "{value:.1}{unit}")
    }
}

/// Serde helper: a size given as a TOML integer or a string like `"64G"`.
pub mod serde_size {
    use serde::{de, Deserializer, Serializer};

    /// Serializes a size as the string `HumanSize` gives (`"512K"`; 0 as
    /// the integer), which [`deserialize`] reads back: effective configs
    /// print as operators write them.
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        if *v == 0 {
            return s.serialize_u64(0);
        }
        s.collect_str(&super::HumanSize(*v))
    }

    struct Size;

    impl de::Visitor<'_> for Size {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a size: a whole number of bytes or a string like \"64G\"")
        }

        fn visit_u64<E: de::Error>(self, n: u64) -> Result<u64, E> {
            Ok(n)
        }

        fn visit_i64<E: de::Error>(self, n: i64) -> Result<u64, E> {
            u64::try_from(n).map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<u64, E> {
            super::parse_size(s).map_err(E::custom)
        }
    }

    /// Deserializes a size.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(Size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn approximate_sizes_read_well() {
        assert_eq!(ApproxSize(512).to_string(), "512");
        assert_eq!(ApproxSize(64 << 20).to_string(), "64M");
        assert_eq!(ApproxSize(67_193_344).to_string(), "64.1M");
        assert_eq!(ApproxSize(15_667_240 << 10).to_string(), "14.9G");
        assert_eq!(ApproxSize(1536).to_string(), "1.5K");
    }

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("1m").unwrap(), 1 << 20);
        assert_eq!(parse_size("64G").unwrap(), 64 << 30);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_size(" 8 MB ").unwrap(), 8 << 20);
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        assert_eq!(
            parse_size("G").unwrap_err().reason,
            "must start with a number"
        );
        assert_eq!(parse_size("12Q").unwrap_err().reason, "unknown unit");
        assert_eq!(
            parse_size("99999999999T").unwrap_err().reason,
            "overflows 64 bits"
        );
        let msg = parse_size("-1").unwrap_err().to_string();
        assert!(msg.contains("\"-1\""), "{msg}");
    }

    #[test]
    fn formats_exact_units() {
        assert_eq!(HumanSize(64 << 30).to_string(), "64G");
        assert_eq!(HumanSize(1536).to_string(), "1536");
        assert_eq!(HumanSize(3 << 20).to_string(), "3M");
        assert_eq!(HumanSize(0).to_string(), "0");
    }
}
