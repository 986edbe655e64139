//! `--set KEY=VALUE` overrides: parsed at the edge, applied to a config's
//! TOML table before it is deserialized and validated.

use super::ConfigError;

/// `--set KEY=VALUE` settings, parsed and checked once where they come in
/// (the binary's flags, the Python module's keywords). Libraries take them
/// typed and apply them to a config they read themselves (a checkpoint's,
/// an export's).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    settings: Vec<Setting>,
}

#[derive(Clone, Debug, PartialEq)]
struct Setting {
    /// The dotted key, by segment.
    path: Vec<String>,
    value: toml::Value,
}

impl Overrides {
    pub fn none() -> Overrides {
        Overrides::default()
    }

    /// `a.b.c=value` assignments: the value is read as TOML; a bare word is
    /// taken as a string.
    pub fn parse<S: AsRef<str>>(assignments: &[S]) -> Result<Overrides, ConfigError> {
        let settings = assignments.iter().map(|a| parse_assignment(a.as_ref())).collect::<Result<_, _>>()?;
        Ok(Overrides { settings })
    }

    /// One more setting (a key the caller spells: dotted bare words).
    pub fn set(mut self, key: &str, value: impl Into<toml::Value>) -> Overrides {
        self.settings.push(Setting { path: key.split('.').map(str::to_string).collect(), value: value.into() });
        self
    }

    pub fn is_empty(&self) -> bool {
        self.settings.is_empty()
    }

    pub(super) fn apply(&self, table: &mut toml::Table) -> Result<(), ConfigError> {
        for Setting { path, value } in &self.settings {
            let (last, parents) =
                path.split_last().ok_or_else(|| ConfigError::BadAssignment { assignment: String::new() })?;
            let mut node = &mut *table;
            for segment in parents {
                let entry = node.entry(segment.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
                node = match entry {
                    toml::Value::Table(t) => t,
                    _ => return Err(ConfigError::NotATable { key: path.join("."), segment: segment.clone() }),
                };
            }
            node.insert(last.clone(), value.clone());
        }
        Ok(())
    }
}

/// `a.b.c=value`: the value is read as TOML; a bare word is taken as a string.
fn parse_assignment(assignment: &str) -> Result<Setting, ConfigError> {
    let bad = || ConfigError::BadAssignment { assignment: assignment.to_string() };
    let (key, raw) = assignment.split_once('=').ok_or_else(bad)?;
    let key = key.trim();
    // A dotted name of bare keys: nothing else can be smuggled into the table.
    let bare = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !key.split('.').all(bare) {
        return Err(bad());
    }
    let raw = raw.trim();
    let value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) if t.len() == 1 => t.remove("v"),
        // `1\n[evil]\nx = 2`: more than one value.
        Ok(_) => return Err(bad()),
        Err(_) => None,
    };
    let value = match value {
        Some(v) => v,
        // A bare word is a string; a line break or control byte in one is a mistake.
        None if raw.chars().any(char::is_control) => return Err(bad()),
        None => toml::Value::String(raw.to_string()),
    };
    Ok(Setting { path: key.split('.').map(str::to_string).collect(), value })
}
