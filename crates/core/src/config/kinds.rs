//! `model.kind`: the dense network a job trains, by name.
//!
//! The kinds themselves live in the model crate, one file each, found
//! through its registry (`sparrow_model::kinds::KINDS`): this crate does
//! not know them. A name the registry lacks is refused where the config is
//! first used (the command line's loader, the model's builder), naming the
//! key and the kinds there are.

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(transparent)]
pub struct ModelKind(String);

impl ModelKind {
    /// The kind called `name` (not checked against the registry here).
    pub fn named(name: &str) -> ModelKind {
        ModelKind(name.to_string())
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// Whether this is the kind called `name`.
    pub fn is(&self, name: &str) -> bool {
        self.0 == name
    }
}

impl Default for ModelKind {
    fn default() -> Self {
        ModelKind::named("dlrm")
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// The allowed names are the model crate's registry: the command line
// (`sparrow config --schema`) adds them to this schema as a `oneOf`.
impl schemars::JsonSchema for ModelKind {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ModelKind".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A kind's name, as `sparrow kinds` lists them.",
        })
    }
}
