//! `sparrow serve`: its flags and the process-wide settings serving wants
//! (the allocator hands memory back; signals stop the server).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The export (or a directory whose LATEST names the newest).
    #[arg(long)]
    model: PathBuf,
    /// Address to bind. Off loopback, SPARROW_AUTH_TOKEN must be set (every
    /// request but the health probes then carries `Authorization: Bearer
    /// TOKEN`), or --no-auth given.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The model's name in URLs: letters, digits, `-`, `_`, `.` (default:
    /// the export directory's name; with --watch, `model`).
    #[arg(long)]
    name: Option<String>,
    /// Request bodies larger than this are refused (413).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
    /// Requests with more rows than this are refused (413), counted while
    /// the body is read; rows within it are scored 1024 at a time.
    #[arg(long, default_value_t = 16_384)]
    max_batch_rows: usize,
    /// Requests whose behaviour sequences and multi-hot cells hold more
    /// IDs than this together are refused (413); each cell holds at most
    /// 100 000.
    #[arg(long, default_value_t = 1 << 20)]
    max_request_ids: usize,
    /// Connections open at once; past it a new connection closes the one
    /// idle longest, or is refused (503) when all are busy.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// A request's head must arrive within this time of its first byte (or
    /// of the connection's opening).
    #[arg(long, default_value_t = 5_000)]
    header_read_timeout_ms: u64,
    /// A kept-alive connection with no request is closed after this long.
    #[arg(long, default_value_t = 60_000)]
    idle_timeout_ms: u64,
    /// A request not answered within this time (its body read included)
    /// gets 408 and its connection is closed.
    #[arg(long, default_value_t = 30_000)]
    request_timeout_ms: u64,
    /// Serve without checking tokens on any address: for a server behind an
    /// authenticating proxy (said on start).
    #[arg(long)]
    no_auth: bool,
    /// Keep serving the newest export: `--model` is a directory whose
    /// LATEST names it (`checkpoint.dir/exports`, written by
    /// `checkpoint.export_every_steps`); each new one is applied without
    /// a restart and without failing a request.
    #[arg(long)]
    watch: bool,
    /// With --watch: how often LATEST is read, in milliseconds.
    #[arg(long, default_value_t = 200)]
    watch_interval_ms: u64,
    /// With --watch: /v2/health/ready answers 503 once the newest export
    /// has failed to load for this long (the old model is still served).
    #[arg(long, default_value_t = 60_000)]
    watch_unready_after_ms: u64,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let token = crate::env_token()?;
    let auth = sparrow_serve::Auth::for_listen(args.listen, token.as_deref(), args.no_auth)?;
    if args.no_auth {
        eprintln!(
            "warning: --no-auth: requests to {} are not authenticated; an authenticating proxy in front must be",
            args.listen
        );
    }
    let options = sparrow_serve::ServeOptions {
        model: args.model,
        listen: args.listen,
        name: args.name,
        max_body_bytes: args.max_body_bytes,
        max_batch_rows: args.max_batch_rows,
        max_request_ids: args.max_request_ids,
        limits: sparrow_serve::ConnectionLimits {
            max_connections: args.max_connections,
            header_read_timeout: Duration::from_millis(args.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(args.idle_timeout_ms),
            request_timeout: Duration::from_millis(args.request_timeout_ms),
        },
        auth,
        watch: args.watch.then(|| Duration::from_millis(args.watch_interval_ms)),
        watch_unready_after: Duration::from_millis(args.watch_unready_after_ms),
        release_memory: Some(release_memory),
        overrides: crate::edge_overrides(&[])?,
    };
    hand_back_freed_memory();
    let on_listening = |addr: SocketAddr, name: &str| {
        eprintln!("serving model `{name}` at http://{addr}/v2/models/{name}");
        crate::print_json(&serde_json::json!({"model": name, "listening": addr.to_string()})).ok();
    };
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { if let Some(t) = term.as_mut() { t.recv().await; } else { std::future::pending::<()>().await } } => {}
        }
    };
    sparrow_serve::serve(&options, on_listening, stop)?;
    Ok(())
}

/// Training keeps freed pages (the next step reuses them); a server's large
/// request is a peak that must not stay, so mimalloc's purge delay goes
/// back to its default (unless the user set `MIMALLOC_PURGE_DELAY`).
fn hand_back_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        #[expect(unsafe_code, reason = "FFI call into mimalloc")]
        // SAFETY: mi_option_set takes any option id and value and only
        // stores the value (options are plain integers read at each purge).
        unsafe {
            libmimalloc_sys::mi_option_set(crate::MI_OPTION_PURGE_DELAY, DEFAULT_PURGE_DELAY_MS);
        }
    }
}

/// mimalloc v3's own purge delay (options.c).
const DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// After a large request, on the thread that answered it: its freed pages
/// go back to the system at once.
fn release_memory() {
    #[expect(unsafe_code, reason = "FFI call into mimalloc")]
    // SAFETY: mi_collect only walks the calling thread's heap and the
    // allocator's free lists; it takes no pointer of ours.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}
