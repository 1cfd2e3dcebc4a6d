//! The manual of a config file (`arenad.toml(5)`, `ublkd.toml(5)`), made
//! from the config's own code so it cannot drift from what the daemon
//! reads:
//!
//! - what each key means and its type: one [`KeyDoc`] per key, in a table
//!   next to the config (`arenad::config_doc`, ublkd's `config_doc`): the
//!   only part written by hand, since it is prose for operators;
//! - which keys there are: [`schema_keys`] asks the config's `Deserialize`
//!   impl itself (the field names serde knows, nested tables, `Option`s and
//!   the values of enums), and [`problems`] holds the table to it, both
//!   ways;
//! - each key's default: the config's defaults serialized to TOML
//!   ([`toml_leaves`]), never typed again;
//! - whether a reload applies it: the daemon's reload code answers, through
//!   the function each table module passes to [`entries`].
//!
//! The man page generator (`daemon/examples/package-docs.rs`) renders the
//! [`Entry`] list; the tests of each table module run [`problems`].

use std::collections::{BTreeMap, BTreeSet};

use serde::de::value::Error as ProbeError;
use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};
use serde::Serialize;

/// Whether `systemctl reload` (SIGHUP) puts a changed key in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reload {
    /// Applied by a reload, while the daemon runs.
    Applied,
    /// Logged as `config.restart_needed`; in force after a restart.
    Restart,
}

/// A key's type as the manual names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    /// `true` or `false`.
    Bool,
    /// A whole number.
    Int,
    /// Bytes: an integer or a string with a binary unit (`"64M"`).
    Size,
    /// A string.
    Str,
    /// A file system path (a string).
    Path,
    /// One of the strings the schema's enum accepts (listed from it).
    Choice,
    /// An array of strings.
    Strings,
}

/// One key of a config file, as its manual describes it.
#[derive(Clone, Copy, Debug)]
pub struct KeyDoc {
    /// Dotted key: `listen`, `device.depth`, `volume.quota` (a key of
    /// every `[[volume]]` table).
    pub key: &'static str,
    /// Its type.
    pub ty: Type,
    /// What it does, for an operator: one or a few sentences; `` `x` ``
    /// marks a literal (rendered in bold).
    pub meaning: &'static str,
}

/// What the schema's `Deserialize` impl asks for at a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A boolean.
    Bool,
    /// An integer.
    Int,
    /// A float.
    Float,
    /// A string (or a path).
    Str,
    /// Any value, its impl decides (a size: integer or string).
    Any,
    /// One of these strings (an enum's variants, in serde's spelling).
    Choice(&'static [&'static str]),
    /// An array of these.
    Array(Box<Kind>),
    /// A table of free keys.
    Map,
}

/// A key of a schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaKey {
    /// What it takes.
    pub kind: Kind,
    /// An `Option`: absent from the file is a value of its own.
    pub optional: bool,
}

/// Every key `T` reads, dotted (`device.depth`; the keys of an array of
/// tables under the array's name, `volume.quota`), with what it takes.
/// Tables are not keys of their own; their keys are. Found by running
/// `T`'s `Deserialize` impl on a deserializer that answers every struct
/// with all its fields, every `Option` with `Some`, every array with one
/// element and every enum with its first variant, and records what each
/// field asked for.
pub fn schema_keys<T: DeserializeOwned>() -> Result<BTreeMap<String, SchemaKey>, String> {
    let mut out = BTreeMap::new();
    T::deserialize(Probe {
        path: String::new(),
        optional: false,
        out: &mut out,
    })
    .map_err(|e| format!("the schema cannot be walked: {e}"))?;
    Ok(out)
}

/// Every leaf of `cfg` serialized to TOML, as `dotted.key -> value` in TOML
/// spelling (strings quoted); the leaves of an array of tables under the
/// array's name (`volume.quota`), from its first table. An empty array is
/// a leaf `[]`.
pub fn toml_leaves<T: Serialize>(cfg: &T) -> Result<BTreeMap<String, String>, String> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        let join = |k: &str| join(prefix, k);
        match v {
            toml::Value::Table(t) => t.iter().for_each(|(k, v)| walk(&join(k), v, out)),
            toml::Value::Array(a) if !a.is_empty() && a.iter().all(toml::Value::is_table) => {
                walk(prefix, &a[0], out)
            }
            leaf => {
                out.insert(prefix.to_owned(), leaf.to_string());
            }
        }
    }
    let v = toml::Value::try_from(cfg).map_err(|e| format!("cannot serialize: {e}"))?;
    let mut out = BTreeMap::new();
    walk("", &v, &mut out);
    Ok(out)
}

/// One key of a manual, ready to render.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Dotted key.
    pub key: &'static str,
    /// Its type in words (a choice lists its values: `"text" | "json"`).
    pub ty: String,
    /// Its default in TOML spelling, `unset` for an `Option` absent by
    /// default, `required` for a key its table cannot do without.
    pub default: String,
    /// Whether a reload applies it.
    pub reload: Reload,
    /// What it does.
    pub meaning: &'static str,
}

/// The entries of `keys`, in their order: defaults from `defaults` (the
/// TOML leaves of the config's defaults, see [`toml_leaves`]), types and
/// optionality from the schema `T`, reload from `reload`. Fails on the
/// first [`problems`] of the table.
pub fn entries<T: DeserializeOwned>(
    keys: &[KeyDoc],
    defaults: &BTreeMap<String, String>,
    reload: impl Fn(&str) -> Reload,
) -> Result<Vec<Entry>, String> {
    let schema = schema_keys::<T>()?;
    let found = problems(keys, &schema, defaults);
    if !found.is_empty() {
        return Err(found.join("; "));
    }
    Ok(keys
        .iter()
        .map(|k| {
            let s = &schema[k.key];
            let ty = match (&k.ty, &s.kind) {
                (Type::Choice, Kind::Choice(values)) => values
                    .iter()
                    .map(|v| format!("\"{v}\""))
                    .collect::<Vec<_>>()
                    .join(" | "),
                (ty, _) => ty.name().to_owned(),
            };
            let default = match defaults.get(k.key) {
                Some(v) => v.clone(),
                None if s.optional => "unset".into(),
                None => "required".into(),
            };
            Entry {
                key: k.key,
                ty,
                default,
                reload: reload(k.key),
                meaning: k.meaning,
            }
        })
        .collect())
}

/// What is wrong with the table `keys` of a config whose schema is
/// `schema` and whose defaults' leaves are `defaults`: a key of the schema
/// with no entry or more than one, an entry naming no key of the schema, a
/// type that is not what the schema takes, a default for a key that is not
/// in the table, an entry with no meaning. Empty: the table is whole.
pub fn problems(
    keys: &[KeyDoc],
    schema: &BTreeMap<String, SchemaKey>,
    defaults: &BTreeMap<String, String>,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for k in keys {
        if !seen.insert(k.key) {
            out.push(format!("{}: documented twice", k.key));
        }
        match schema.get(k.key) {
            None => out.push(format!(
                "{}: documented, but the config has no such key",
                k.key
            )),
            Some(s) if !k.ty.takes(&s.kind) => out.push(format!(
                "{}: documented as {}, but the schema takes {:?}",
                k.key,
                k.ty.name(),
                s.kind
            )),
            Some(_) => {}
        }
        if k.meaning.trim().is_empty() {
            out.push(format!("{}: no meaning", k.key));
        }
    }
    for key in schema.keys() {
        if !seen.contains(key.as_str()) {
            out.push(format!(
                "{key}: a key of the config with no entry in its manual"
            ));
        }
    }
    for key in defaults.keys() {
        if !seen.contains(key.as_str()) && !schema.contains_key(key) && !is_table_array(key, schema)
        {
            out.push(format!(
                "{key}: serialized by the config, but not documented"
            ));
        }
    }
    out
}

/// `key` is an array of tables of the schema (serialized `[]` when empty).
fn is_table_array(key: &str, schema: &BTreeMap<String, SchemaKey>) -> bool {
    let prefix = format!("{key}.");
    schema.keys().any(|k| k.starts_with(&prefix))
}

impl Type {
    /// The manual's word for it.
    pub fn name(self) -> &'static str {
        match self {
            Type::Bool => "boolean",
            Type::Int => "integer",
            Type::Size => "size",
            Type::Str => "string",
            Type::Path => "path",
            Type::Choice => "string",
            Type::Strings => "array of strings",
        }
    }

    /// Whether a key documented as `self` takes `kind`.
    fn takes(self, kind: &Kind) -> bool {
        match (self, kind) {
            (Type::Bool, Kind::Bool) | (Type::Int, Kind::Int) | (Type::Size, Kind::Any) => true,
            (Type::Str | Type::Path, Kind::Str) => true,
            (Type::Choice, Kind::Choice(_)) => true,
            (Type::Strings, Kind::Array(k)) => **k == Kind::Str,
            _ => false,
        }
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

/// The deserializer of [`schema_keys`], at one key.
struct Probe<'a> {
    path: String,
    optional: bool,
    out: &'a mut BTreeMap<String, SchemaKey>,
}

impl Probe<'_> {
    fn leaf(&mut self, kind: Kind) {
        self.out.insert(
            self.path.clone(),
            SchemaKey {
                kind,
                optional: self.optional,
            },
        );
    }
}

macro_rules! leaves {
    ($($method:ident => $kind:expr, $visit:ident($($value:expr)?);)*) => {
        $(fn $method<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, ProbeError> {
            self.leaf($kind);
            v.$visit($($value)?)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    leaves! {
        deserialize_any => Kind::Any, visit_u64(0);
        deserialize_bool => Kind::Bool, visit_bool(false);
        deserialize_i8 => Kind::Int, visit_i64(0);
        deserialize_i16 => Kind::Int, visit_i64(0);
        deserialize_i32 => Kind::Int, visit_i64(0);
        deserialize_i64 => Kind::Int, visit_i64(0);
        deserialize_u8 => Kind::Int, visit_u64(0);
        deserialize_u16 => Kind::Int, visit_u64(0);
        deserialize_u32 => Kind::Int, visit_u64(0);
        deserialize_u64 => Kind::Int, visit_u64(0);
        deserialize_f32 => Kind::Float, visit_f64(0.0);
        deserialize_f64 => Kind::Float, visit_f64(0.0);
        deserialize_char => Kind::Str, visit_char('a');
        deserialize_str => Kind::Str, visit_str("");
        deserialize_string => Kind::Str, visit_str("");
        deserialize_bytes => Kind::Str, visit_bytes(&[]);
        deserialize_byte_buf => Kind::Str, visit_bytes(&[]);
        deserialize_unit => Kind::Any, visit_unit();
        deserialize_identifier => Kind::Str, visit_str("");
        deserialize_ignored_any => Kind::Any, visit_unit();
    }

    fn deserialize_option<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, ProbeError> {
        self.optional = true;
        v.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_unit(v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        let (path, optional, out) = (self.path, self.optional, self.out);
        let element = Probe {
            path: path.clone(),
            optional: false,
            out: &mut *out,
        };
        let value = v.visit_seq(One(Some(element)))?;
        // An array of scalars is a key whose element was recorded at its
        // path; an array of tables recorded the tables' keys below it.
        if let Some(k) = out.get_mut(&path) {
            k.kind = Kind::Array(Box::new(k.kind.clone()));
            k.optional = optional;
        }
        Ok(value)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, v: V) -> Result<V::Value, ProbeError> {
        self.deserialize_seq(v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_seq(v)
    }

    fn deserialize_map<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, ProbeError> {
        self.leaf(Kind::Map);
        v.visit_map(Fields {
            fields: &[],
            next: 0,
            path: self.path,
            out: self.out,
        })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        v.visit_map(Fields {
            fields,
            next: 0,
            path: self.path,
            out: self.out,
        })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        mut self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.leaf(Kind::Choice(variants));
        let first = variants
            .first()
            .ok_or_else(|| de::Error::custom("an enum without variants"))?;
        v.visit_enum(IntoDeserializer::<ProbeError>::into_deserializer(*first))
    }
}

/// A struct's fields, each answered by a [`Probe`] at its key.
struct Fields<'a> {
    fields: &'static [&'static str],
    next: usize,
    path: String,
    out: &'a mut BTreeMap<String, SchemaKey>,
}

impl<'de> de::MapAccess<'de> for Fields<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ProbeError> {
        match self.fields.get(self.next) {
            None => Ok(None),
            Some(f) => seed
                .deserialize(IntoDeserializer::<ProbeError>::into_deserializer(*f))
                .map(Some),
        }
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ProbeError> {
        let field = self.fields[self.next];
        self.next += 1;
        seed.deserialize(Probe {
            path: join(&self.path, field),
            optional: false,
            out: &mut *self.out,
        })
    }
}

/// An array of one element.
struct One<'a>(Option<Probe<'a>>);

impl<'de> de::SeqAccess<'de> for One<'_> {
    type Error = ProbeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ProbeError> {
        self.0.take().map(|p| seed.deserialize(p)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(rename_all = "lowercase")]
    enum Mode {
        Fast,
        Slow,
    }

    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        name: String,
        #[serde(with = "crate::service::size::serde_size")]
        quota: u64,
    }

    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Schema {
        #[serde(default)]
        on: bool,
        #[serde(default)]
        depth: Option<u32>,
        #[serde(default = "fast")]
        mode: Mode,
        #[serde(default)]
        hosts: Vec<String>,
        #[serde(default, rename = "volume")]
        volumes: Vec<Inner>,
        #[serde(default)]
        sub: Option<Sub>,
    }

    #[derive(serde::Deserialize, serde::Serialize)]
    struct Sub {
        path: std::path::PathBuf,
    }

    fn fast() -> Mode {
        Mode::Fast
    }

    const KEYS: &[KeyDoc] = &[
        KeyDoc {
            key: "on",
            ty: Type::Bool,
            meaning: "m",
        },
        KeyDoc {
            key: "depth",
            ty: Type::Int,
            meaning: "m",
        },
        KeyDoc {
            key: "mode",
            ty: Type::Choice,
            meaning: "m",
        },
        KeyDoc {
            key: "hosts",
            ty: Type::Strings,
            meaning: "m",
        },
        KeyDoc {
            key: "volume.name",
            ty: Type::Str,
            meaning: "m",
        },
        KeyDoc {
            key: "volume.quota",
            ty: Type::Size,
            meaning: "m",
        },
        KeyDoc {
            key: "sub.path",
            ty: Type::Path,
            meaning: "m",
        },
    ];

    fn defaults() -> BTreeMap<String, String> {
        toml_leaves(&toml::from_str::<Schema>("").unwrap()).unwrap()
    }

    #[test]
    fn the_schema_names_every_key_nested_optional_and_in_arrays_of_tables() {
        let s = schema_keys::<Schema>().unwrap();
        let keys: Vec<&str> = s.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "depth",
                "hosts",
                "mode",
                "on",
                "sub.path",
                "volume.name",
                "volume.quota"
            ]
        );
        assert_eq!(s["depth"].kind, Kind::Int);
        assert!(s["depth"].optional && !s["on"].optional && !s["sub.path"].optional);
        assert_eq!(s["mode"].kind, Kind::Choice(&["fast", "slow"]));
        assert_eq!(s["hosts"].kind, Kind::Array(Box::new(Kind::Str)));
        assert_eq!(s["volume.quota"].kind, Kind::Any);
    }

    #[test]
    fn entries_take_defaults_from_the_serialized_config_and_reload_from_the_caller() {
        let d = defaults();
        assert_eq!(d.get("volume").map(String::as_str), Some("[]"));
        let e = entries::<Schema>(KEYS, &d, |k| {
            if k == "on" {
                Reload::Applied
            } else {
                Reload::Restart
            }
        })
        .unwrap();
        let get = |k: &str| e.iter().find(|e| e.key == k).unwrap().clone();
        assert_eq!(
            (get("on").default, get("on").reload),
            ("false".to_string(), Reload::Applied)
        );
        assert_eq!(get("mode").default, "\"fast\"");
        assert_eq!(get("mode").ty, "\"fast\" | \"slow\"");
        assert_eq!(get("depth").default, "unset");
        assert_eq!(get("volume.name").default, "required");
        assert_eq!(get("hosts").default, "[]");
        assert_eq!(get("sub.path").reload, Reload::Restart);
    }

    #[test]
    fn a_missing_extra_twice_or_mistyped_entry_is_a_problem() {
        let schema = schema_keys::<Schema>().unwrap();
        assert_eq!(problems(KEYS, &schema, &defaults()), Vec::<String>::new());
        let dropped: Vec<KeyDoc> = KEYS.iter().filter(|k| k.key != "depth").copied().collect();
        assert_eq!(
            problems(&dropped, &schema, &defaults()),
            ["depth: a key of the config with no entry in its manual"]
        );
        let mut extra = KEYS.to_vec();
        extra.push(KeyDoc {
            key: "colour",
            ty: Type::Str,
            meaning: "m",
        });
        extra.push(KEYS[0]);
        assert_eq!(
            problems(&extra, &schema, &defaults()),
            [
                "colour: documented, but the config has no such key",
                "on: documented twice"
            ]
        );
        let mut wrong = KEYS.to_vec();
        wrong[0].ty = Type::Int;
        wrong[1].meaning = " ";
        assert_eq!(
            problems(&wrong, &schema, &defaults()),
            [
                "on: documented as integer, but the schema takes Bool",
                "depth: no meaning"
            ]
        );
        let mut serialized = defaults();
        serialized.insert("secret".into(), "1".into());
        assert_eq!(
            problems(KEYS, &schema, &serialized),
            ["secret: serialized by the config, but not documented"]
        );
        assert!(entries::<Schema>(&dropped, &defaults(), |_| Reload::Restart).is_err());
    }
}
