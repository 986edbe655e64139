//! What a command reads at the edge, before the libraries (which never
//! look at the environment): the config file (bounded: a data file or a
//! device given by mistake is refused, not read whole), `--set` and
//! `SPARROW_SIMD`, and the shared token `SPARROW_AUTH_TOKEN` (refused at
//! start when no request header could carry it).

use std::path::Path;

use anyhow::Context;
use sparrow_core::{Config, Overrides};

/// `SPARROW_SIMD`, read here at the edge: `train.simd` for every config
/// this process builds (a value other than auto, avx512, avx2 or portable is an error).
pub(crate) fn simd_from_env() -> anyhow::Result<Option<sparrow_core::simd::Simd>> {
    use sparrow_core::simd::{Simd, VARIABLE};
    match std::env::var(VARIABLE) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(v) => Simd::parse(&v).map(Some).map_err(|e| anyhow::anyhow!(e)),
        Err(std::env::VarError::NotUnicode(v)) => {
            anyhow::bail!("{VARIABLE}={v:?}: expected `auto`, `avx512`, `avx2` or `portable`")
        }
    }
}

/// The command line's `--set` assignments, after what the environment sets
/// (`SPARROW_SIMD` as `train.simd`; a `--set` of the same key wins).
pub(crate) fn edge_overrides(set: &[String]) -> anyhow::Result<Overrides> {
    let mut all: Vec<String> = simd_from_env()?.map(|s| format!("train.simd={:?}", s.name())).into_iter().collect();
    all.extend(set.iter().cloned());
    Ok(Overrides::parse(&all)?)
}

/// The config at `path` with `set` applied, checked whole: the model
/// kind's own refusals too (`sparrow_model::kinds::check`), before any
/// command starts work.
pub(crate) fn load_config(path: &Path, set: &[String]) -> anyhow::Result<Config> {
    let text = read_config_text(path)?;
    let config = Config::from_toml(&text, &path.display().to_string(), &edge_overrides(set)?)?;
    sparrow_model::kinds::check(&config)?;
    Ok(config)
}

/// A config file is a few kilobytes of TOML: past this it is something
/// else (a data file, `/dev/zero`), refused before it is read whole.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

fn read_config_text(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let reading = || format!("reading config {}", path.display());
    let file = std::fs::File::open(path).with_context(reading)?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes).with_context(reading)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        anyhow::bail!(
            "config {}: more than {MAX_CONFIG_BYTES} bytes, which no config is (a config is a few kilobytes of TOML): \
             is it a data file?",
            path.display()
        );
    }
    String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("config {}: not UTF-8 text ({e})", path.display()))
}

/// The shared token from `SPARROW_AUTH_TOKEN` (how `launch` hands it to its
/// children); read here, once, so the library never looks at the environment.
/// One no header could carry is refused at start, naming the variable.
pub(crate) fn env_token() -> anyhow::Result<Option<String>> {
    use sparrow_cluster::net::TOKEN_ENV;
    match std::env::var(TOKEN_ENV) {
        Ok(t) if t.is_empty() => Ok(None),
        Ok(t) => {
            sparrow_core::token::check(&t, TOKEN_ENV).map_err(|e| anyhow::anyhow!(e))?;
            Ok(Some(t))
        }
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            anyhow::bail!("{TOKEN_ENV}: not UTF-8 text: a request's header cannot carry it")
        }
    }
}

/// A cluster job's config with the environment's token in place of
/// `cluster.auth_token` (the environment takes precedence).
pub(crate) fn with_env_token(mut config: Config) -> anyhow::Result<Config> {
    if let Some(token) = env_token()? {
        config.cluster.auth_token = Some(token);
    }
    Ok(config)
}

/// The config with the secrets it points at read: the Kafka password
/// (`data.stream.sasl.password_env` or `password_file`).
pub(crate) fn with_secrets(mut config: Config) -> anyhow::Result<Config> {
    config.resolve_secrets(|name| std::env::var_os(name))?;
    Ok(config)
}
