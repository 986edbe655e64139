//! `sparrow config`: a config as TOML, every key spelled out. `--defaults`
//! prints what a job gets from an empty config; `--config F` prints F as
//! the job reads it (defaults filled in, `--set` applied, checked).

use std::io::Write;

use sparrow_core::Config;

/// Prints `config` (`None`: the defaults) as TOML. Keys without a default
/// (an optional path, a table a job may leave out) are absent.
pub fn print(config: Option<&Config>) -> anyhow::Result<()> {
    let defaults = Config::default();
    let (config, what) = match config {
        Some(c) => (c, "the config as a job reads it: defaults filled in, --set applied"),
        None => (&defaults, "every key with its default"),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "# sparrow {}: {what}.", env!("CARGO_PKG_VERSION"))?;
    writeln!(out, "# Optional keys without a default (data.train, [data.stream], ...) are left out.")?;
    write!(out, "{}", config.to_toml())?;
    out.flush()?;
    Ok(())
}

/// The config's JSON Schema with `model.kind`'s names, the model crate's registry.
fn schema() -> serde_json::Value {
    let mut schema = sparrow_core::config::json_schema();
    sparrow_model::kinds::annotate_schema(&mut schema);
    schema
}

/// Prints the config's JSON Schema (`docs/book/src/config.schema.json`).
pub fn print_schema() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&schema())?)?;
    out.flush()?;
    Ok(())
}

/// Prints the book's configuration chapter (`docs/book/src/configuration.md`).
pub fn print_reference() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    write!(out, "{}", crate::config_reference::markdown(&schema()))?;
    out.flush()?;
    Ok(())
}

/// Prints every model kind of the registry: its name, what it is built
/// for, and one line (`sparrow kinds`).
pub fn print_kinds() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    for kind in sparrow_model::kinds::KINDS {
        let family = match kind.family() {
            sparrow_model::kinds::Family::OneTask if !kind.has_products() => "one binary task",
            sparrow_model::kinds::Family::OneTask => "one or more tasks",
            sparrow_model::kinds::Family::MultiTask => "several tasks",
            sparrow_model::kinds::Family::Sequence => "behaviour sequences",
        };
        writeln!(out, "{:<10} {:<20} {}", kind.name(), family, kind.about())?;
    }
    out.flush()?;
    Ok(())
}
