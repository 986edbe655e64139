//! The config's JSON Schema, derived from the types: each key's doc comment
//! is its description, its default comes from `Default`, its allowed values
//! from its type. `sparrow config --schema` prints it; the book's
//! configuration chapter is rendered from it (`--reference`), so neither is
//! written by hand.

use schemars::generate::SchemaSettings;

use super::Config;

/// The schema as JSON (draft-07, which TOML editors' validators read).
pub fn json_schema() -> serde_json::Value {
    let settings = SchemaSettings::draft07();
    let mut schema = settings.into_generator().into_root_schema_for::<Config>().to_value();
    for_toml(&mut schema);
    super::bounds::annotate(&mut schema);
    schema
}

/// TOML has no null: an optional key is one left out. Drops `null` from
/// the types and defaults schemars writes for an `Option`, and joins a doc
/// comment's wrapped lines back into paragraphs.
fn for_toml(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            map.retain(|key, v| !(v.is_null() && key != "const"));
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if types.len() == 1 {
                    let only = types.pop().unwrap_or_default();
                    map.insert("type".into(), only);
                }
            }
            if let Some(Value::Array(any)) = map.get("anyOf") {
                let kept: Vec<Value> =
                    any.iter().filter(|v| v.get("type") != Some(&Value::from("null"))).cloned().collect();
                if kept.len() == 1 {
                    map.remove("anyOf");
                    map.insert("allOf".into(), Value::Array(kept));
                }
            }
            if let Some(Value::String(text)) = map.get_mut("description") {
                *text = paragraphs(text);
            }
            map.values_mut().for_each(for_toml);
        }
        Value::Array(items) => items.iter_mut().for_each(for_toml),
        _ => {}
    }
}

/// Single line breaks become spaces; blank lines stay paragraph breaks.
fn paragraphs(text: &str) -> String {
    text.split("\n\n")
        .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    /// Every key's path with the schema of its value, tables walked into
    /// (a `$ref`, directly, through `allOf`, or as an array's items).
    fn keys(object: &Value, path: &str, defs: &Value, out: &mut Vec<(String, Value)>) {
        let Some(properties) = object.get("properties").and_then(Value::as_object) else { return };
        for (key, property) in properties {
            let path = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
            out.push((path.clone(), property.clone()));
            let reference = property
                .get("allOf")
                .and_then(|a| a.get(0))
                .or(property.get("items"))
                .unwrap_or(property)
                .get("$ref")
                .and_then(Value::as_str);
            if let Some(name) = reference.and_then(|r| r.rsplit('/').next()) {
                keys(&defs[name], &path, defs, out);
            }
        }
    }

    /// The reference cannot drift: a key added without a doc comment fails
    /// here, naming the key.
    #[test]
    fn every_key_of_the_config_has_a_description() {
        let schema = super::json_schema();
        let mut all = Vec::new();
        keys(&schema, "", &schema["definitions"], &mut all);
        let undocumented: Vec<&str> = all
            .iter()
            .filter(|(_, p)| p.get("description").and_then(Value::as_str).is_none_or(|d| d.trim().is_empty()))
            .map(|(k, _)| k.as_str())
            .collect();
        assert!(
            undocumented.is_empty(),
            "keys without a doc comment (the config reference's description): {undocumented:?}"
        );
        // The walk reaches the nested tables, arrays of tables included.
        for key in ["data.schema.sequence.max_len", "model.tasks.weight", "cluster.lazy.send", "data.stream.start"] {
            assert!(all.iter().any(|(k, _)| k == key), "{key} not reached");
        }
    }

    #[test]
    fn the_schema_states_defaults_and_allowed_values_and_no_nulls() {
        let schema = super::json_schema();
        let text = schema.to_string();
        assert!(!text.contains("\"null\""), "TOML has no null: {text}");
        let model = &schema["definitions"]["ModelConfig"]["properties"];
        assert_eq!(model["embedding_dim"]["default"], 16);
        assert_eq!(model["hidden"]["default"], serde_json::json!([256, 128]));
        // The kinds are the model crate's registry, added by the command line.
        assert_eq!(schema["definitions"]["ModelKind"]["type"], "string");
        assert_eq!(schema["definitions"]["Config"], Value::Null, "the root is the config itself");
        assert_eq!(schema["additionalProperties"], false, "unknown keys are refused, as the loader does");
    }
}
