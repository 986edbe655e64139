//! A config read back from a checkpoint's or an export's manifest. The
//! Sparrow that saved it wrote every key it knew, so a key missing there
//! is younger than the checkpoint: it means what the checkpoint's Sparrow
//! did before the key existed, which a later default need not keep.

use super::{Config, ConfigError, Overrides};

/// Keys whose default changed after they came, with what their absence
/// meant before: `model.norm` came with no norm as its default, before
/// `auto` (batch norm for `din`).
const BEFORE_THEIR_DEFAULT_CHANGED: &[(&str, &str, &str)] = &[("model", "norm", "none")];

impl Config {
    /// Parses a stored config (a manifest's), each key of
    /// [`BEFORE_THEIR_DEFAULT_CHANGED`] it lacks taken as it was meant then,
    /// applies `overrides` and validates.
    pub fn from_stored_toml(text: &str, source_name: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut table: toml::Table = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { source_name: source_name.to_string(), message: e.to_string() })?;
        for &(section, key, then) in BEFORE_THEIR_DEFAULT_CHANGED {
            if let toml::Value::Table(t) =
                table.entry(section).or_insert_with(|| toml::Value::Table(toml::Table::new()))
            {
                t.entry(key).or_insert_with(|| toml::Value::String(then.to_string()));
            }
        }
        Config::from_table(table, source_name, overrides)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NormSetting;

    #[test]
    fn a_stored_config_without_model_norm_means_no_norm_and_one_with_it_keeps_it() {
        let stored = |text: &str| Config::from_stored_toml(text, "manifest", &Overrides::none()).expect("config");
        let din = "[model]\nkind = \"din\"\n";
        assert_eq!(stored(din).model.norm, NormSetting::None, "written before model.norm existed");
        assert_eq!(stored("").model.norm, NormSetting::None, "no [model] table at all");
        let auto = format!("{din}norm = \"auto\"\n");
        assert_eq!(stored(&auto).model.norm, NormSetting::Auto);
        // A config a user writes takes today's default.
        assert_eq!(
            Config::from_toml(din, "job.toml", &Overrides::none()).expect("config").model.norm,
            NormSetting::Auto
        );
        // An override still wins.
        let set = Overrides::parse(&["model.norm=\"layer\"".to_string()]).expect("override");
        assert_eq!(Config::from_stored_toml(din, "manifest", &set).expect("config").model.norm, NormSetting::Layer);
    }
}
