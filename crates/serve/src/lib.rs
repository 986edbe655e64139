//! `sparrow serve`: a serving export behind the Open Inference Protocol
//! (KServe v2 REST: `GET /v2/health/live|ready`, `GET /v2/models/{name}`,
//! `GET /v2/models/{name}/ready`, `POST /v2/models/{name}/infer`), so KServe,
//! Triton and Seldon clients work unchanged, plus `/metrics` for Prometheus.
//! Routed by axum, each connection driven by hyper under the limits of
//! [`connections`].
//!
//! Inputs are the data file's columns by the schema's names (Criteo: `I1`…`I13`
//! as `FP32`, `C1`…`C26` as `BYTES`; CSV: the schema's dense and sparse
//! columns), shape `[N]`; a missing input is an empty cell. Each request row
//! goes through the same line parser as `sparrow predict`, so the output
//! `probability` equals its figures.
//!
//! What a client can make the server spend is bounded: a body's bytes
//! (`max_body_bytes`), a request's rows (`max_batch_rows`, checked while
//! the body is read), the memory of scoring (chunks of
//! [`served::SCORE_CHUNK_ROWS`] rows), connections and how long each may
//! wait ([`ConnectionLimits`]). Off loopback a bearer token is required
//! ([`Auth`]).

mod cells;
pub mod connections;
mod metrics;
pub mod outputs;
pub mod request;
pub mod served;
pub mod watch;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde_json::json;

pub use connections::ConnectionLimits;
pub use served::{Served, Swap};
use watch::WatchHealth;

/// The environment variable that carries the bearer token (the roles' own).
pub const TOKEN_ENV: &str = "SPARROW_AUTH_TOKEN";

/// Paths any client may read without a token: the probes.
const OPEN_PATHS: [&str; 2] = ["/v2/health/live", "/v2/health/ready"];

/// A request larger than this (body bytes or rows) hands its memory back
/// to the system once answered.
const LARGE_REQUEST_BYTES: usize = 1 << 20;

/// How `sparrow serve` runs.
pub struct ServeOptions {
    pub model: PathBuf,
    pub listen: SocketAddr,
    /// The model's name (default: the export directory's name; with
    /// `--watch`, `model`, which a restart keeps).
    pub name: Option<String>,
    /// Requests with a larger body are refused (413).
    pub max_body_bytes: usize,
    /// Requests with more rows are refused (413), counted as they are read.
    pub max_batch_rows: usize,
    /// Requests whose lists, joined sequences and multi-hot cells hold
    /// more IDs together are refused (413).
    pub max_request_ids: usize,
    pub limits: ConnectionLimits,
    pub auth: Auth,
    /// `--watch`: how often `model/LATEST` is read; a new export named
    /// there is applied while serving (None: the model never changes).
    pub watch: Option<Duration>,
    /// `--watch`: readiness turns false once the newest export has failed
    /// this long.
    pub watch_unready_after: Duration,
    /// Called on the thread that answered a large request, after it (the
    /// binary returns its allocator's freed pages to the system here).
    pub release_memory: Option<fn()>,
    /// Applied to every export's stored config (the binary's: `SPARROW_SIMD`
    /// as `train.simd`).
    pub overrides: sparrow_core::Overrides,
}

/// Who may call the server.
#[derive(Clone, Debug)]
pub enum Auth {
    /// Every request but the probes carries `Authorization: Bearer TOKEN`.
    Token(Arc<str>),
    /// Anyone: a loopback address without a token, or `--no-auth`.
    Open,
}

impl Auth {
    /// The roles' rule: with a token, requests must carry it; without one,
    /// only a loopback address may listen, unless `no_auth` says another
    /// layer authenticates (a proxy in front).
    pub fn for_listen(listen: SocketAddr, token: Option<&str>, no_auth: bool) -> Result<Auth, ServeError> {
        match (no_auth, token.filter(|t| !t.is_empty())) {
            (true, _) => Ok(Auth::Open),
            (false, Some(t)) => Ok(Auth::Token(Arc::from(t))),
            (false, None) if listen.ip().is_loopback() => Ok(Auth::Open),
            (false, None) => Err(ServeError::Setup(format!(
                "refusing to serve on {listen} without a token: set {TOKEN_ENV} (requests then carry \
                 `Authorization: Bearer TOKEN`), or pass --no-auth when an authenticating proxy is in front \
                 (only loopback addresses may serve without either)"
            ))),
        }
    }

    fn admits(&self, request: &hyper::Request<hyper::body::Incoming>) -> bool {
        match self {
            Auth::Open => true,
            Auth::Token(token) => {
                OPEN_PATHS.contains(&request.uri().path())
                    || sparrow_core::token::bearer_matches(
                        request.headers().get(axum::http::header::AUTHORIZATION).map(|v| v.as_bytes()),
                        token,
                    )
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Model(#[from] sparrow_trainer::TrainError),
    #[error("{0}")]
    Setup(String),
    #[error("listening on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
}

/// A request the server refuses: its status and message (KServe's `{"error": …}`).
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl ApiError {
    fn internal(message: String) -> ApiError {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, axum::Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message.into())
}

/// Whether `name` can stand in a URL path segment as a model's name.
pub fn valid_model_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The name a model is served as: `--name` (checked), else with `--watch`
/// `model` (stable across the exports LATEST names, and restarts), else the
/// export directory's name where it is a valid one.
pub fn model_name(options: &ServeOptions) -> Result<String, ServeError> {
    if let Some(name) = &options.name {
        if !valid_model_name(name) {
            return Err(ServeError::Setup(format!(
                "--name {name:?}: a model's name is 1 to 128 letters, digits, `-`, `_` or `.` (it is part of the URL)"
            )));
        }
        return Ok(name.clone());
    }
    if options.watch.is_some() {
        return Ok("model".into());
    }
    let dir = sparrow_trainer::export::resolve_export(&options.model).unwrap_or_else(|_| options.model.clone());
    Ok(dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .filter(|n| valid_model_name(n))
        .unwrap_or_else(|| "model".into()))
}

/// What every request sees.
struct App {
    served: Arc<Served>,
    watch: Option<Arc<WatchHealth>>,
    limits: request::Limits,
    max_body_bytes: usize,
    release_memory: Option<fn()>,
}

async fn infer(
    State(app): State<Arc<App>>,
    UrlPath(name): UrlPath<String>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Response {
    let start = Instant::now();
    let served = &app.served;
    let body = match model(served, &name) {
        Err(e) => Err(e),
        Ok(_) => read_body(body, &headers, app.max_body_bytes).await,
    };
    let answer = match body {
        Err(e) => Err(e),
        Ok(body) => {
            let app = app.clone();
            tokio::task::spawn_blocking(move || {
                let large = body.len() > LARGE_REQUEST_BYTES;
                let binary_header = headers.get(request::BINARY_HEADER).map(|v| v.as_bytes());
                let refused = |e| match e {
                    request::DecodeError::OverLimit(m) => ApiError(StatusCode::PAYLOAD_TOO_LARGE, m),
                    request::DecodeError::Bad(m) => bad(m),
                };
                // The body is dropped at the block's end, before memory is released.
                let answer = match request::Body::new(binary_header, body) {
                    Err(e) => Err(refused(e)),
                    Ok(body) => body.decode(&app.limits).map_err(refused).and_then(|request| {
                        let scores = app.served.infer(&request, app.limits.max_ids)?;
                        let large = large || scores.rows > served::SCORE_CHUNK_ROWS;
                        Ok((reply(&app.served, request, scores), large))
                    }),
                };
                if let Some(release) = app.release_memory
                    && (large || answer.as_ref().is_ok_and(|(_, large)| *large))
                {
                    release();
                }
                answer.map(|(reply, _)| reply)
            })
            .await
            .unwrap_or_else(|e| Err(ApiError::internal(e.to_string())))
        }
    };
    let response = answer.unwrap_or_else(IntoResponse::into_response);
    served.metrics.requests.with_label_values(&[response.status().as_str()]).inc();
    served.metrics.seconds.observe(start.elapsed().as_secs_f64());
    response
}

/// A request's body, refused (413) past `max` bytes. Read into one buffer
/// of the declared length, chunk by chunk, so a body at the limit costs
/// its size once (collecting chunks and then joining them costs it twice).
async fn read_body(body: axum::body::Body, headers: &axum::http::HeaderMap, max: usize) -> Result<Bytes, ApiError> {
    use http_body_util::BodyExt;
    let too_large = |n: String| {
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a body of {n} bytes, more than this server's --max-body-bytes ({max})"),
        )
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max as u64) {
        return Err(too_large(n.to_string()));
    }
    let mut out = Vec::with_capacity(declared.map_or(0, |n| n as usize));
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| bad(format!("the body cannot be read: {e}")))?;
        let Ok(chunk) = frame.into_data() else { continue };
        if out.len() + chunk.len() > max {
            return Err(too_large(format!("more than {}", out.len() + chunk.len())));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

/// The reply: JSON, or with the output as binary data (KServe's binary extension).
fn reply(served: &Served, request: request::Request, scores: served::Scores) -> Response {
    let n = scores.rows;
    let outputs: Vec<serde_json::Value> = scores
        .outputs
        .iter()
        .map(|o| {
            let shape = if o.per_row == 1 { json!([n]) } else { json!([n, o.per_row]) };
            let mut output = json!({"name": o.name, "datatype": "FP32", "shape": shape});
            if request.binary_output {
                output["parameters"] = json!({ "binary_data_size": o.values.len() * 4 });
            } else {
                output["data"] = json!(o.values);
            }
            output
        })
        .collect();
    let mut head = json!({
        "model_name": served.name(),
        "model_version": scores.version.to_string(),
        "outputs": outputs,
    });
    if let Some(id) = request.id {
        head["id"] = json!(id);
    }
    if !request.binary_output {
        return (StatusCode::OK, axum::Json(head)).into_response();
    }
    let mut body = serde_json::to_vec(&head).unwrap_or_default();
    let json_len = body.len();
    for v in scores.outputs.iter().flat_map(|o| &o.values) {
        body.extend_from_slice(&v.to_le_bytes());
    }
    (
        StatusCode::OK,
        [
            (axum::http::header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (axum::http::HeaderName::from_static(request::BINARY_HEADER), json_len.to_string()),
        ],
        body,
    )
        .into_response()
}

fn model<'a>(served: &'a Served, name: &str) -> Result<&'a Served, ApiError> {
    if name == served.name() {
        Ok(served)
    } else {
        Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("no model named `{name}` (this server serves `{}`)", served.name()),
        ))
    }
}

/// Ready unless `--watch` has failed past its stated time.
async fn ready(State(app): State<Arc<App>>) -> Response {
    match app.watch.as_ref().and_then(|w| w.unready()) {
        None => StatusCode::OK.into_response(),
        Some(why) => ApiError(StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// The server's routes over one model.
fn router(app: Arc<App>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(ready))
        .route(
            "/v2",
            get(|| async {
                axum::Json(json!({"name": "sparrow", "version": env!("CARGO_PKG_VERSION"), "extensions": []}))
            }),
        )
        .route(
            "/v2/models/{name}",
            get(|State(app): State<Arc<App>>, UrlPath(name): UrlPath<String>| async move {
                model(&app.served, &name).map(|m| axum::Json(m.metadata()))
            }),
        )
        .route(
            "/v2/models/{name}/ready",
            get(|State(app): State<Arc<App>>, UrlPath(name): UrlPath<String>| async move {
                model(&app.served, &name)?;
                Ok::<_, ApiError>(ready(State(app)).await)
            }),
        )
        .route("/v2/models/{name}/infer", post(infer))
        .route("/metrics", get(|State(app): State<Arc<App>>| async move { app.served.metrics.render() }))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(app)
}

/// Checks the options a user gives (each a flag of `sparrow serve`).
fn check_options(options: &ServeOptions) -> Result<(), ServeError> {
    let positive = [
        ("--max-body-bytes", options.max_body_bytes as u128),
        ("--max-batch-rows", options.max_batch_rows as u128),
        ("--max-request-ids", options.max_request_ids as u128),
        ("--max-connections", options.limits.max_connections as u128),
        ("--header-read-timeout-ms", options.limits.header_read_timeout.as_millis()),
        ("--idle-timeout-ms", options.limits.idle_timeout.as_millis()),
        ("--request-timeout-ms", options.limits.request_timeout.as_millis()),
        ("--watch-interval-ms", options.watch.map_or(1, |w| w.as_millis())),
    ];
    for (flag, value) in positive {
        if value == 0 {
            return Err(ServeError::Setup(format!("{flag} 0: must be at least 1")));
        }
    }
    // Deadlines are instants: a duration past a day is a mistake (and
    // u64::MAX milliseconds would overflow one).
    const DAY_MS: u128 = 24 * 3600 * 1000;
    let durations = [
        ("--header-read-timeout-ms", options.limits.header_read_timeout.as_millis()),
        ("--idle-timeout-ms", options.limits.idle_timeout.as_millis()),
        ("--request-timeout-ms", options.limits.request_timeout.as_millis()),
        ("--watch-interval-ms", options.watch.map_or(1, |w| w.as_millis())),
        ("--watch-unready-after-ms", options.watch_unready_after.as_millis()),
    ];
    for (flag, value) in durations {
        if value > DAY_MS {
            return Err(ServeError::Setup(format!("{flag} {value}: at most {DAY_MS} (a day)")));
        }
    }
    Ok(())
}

/// Runs the server until `stop` resolves. `on_listening` gets the bound
/// address and the model's name.
pub fn serve(
    options: &ServeOptions,
    on_listening: impl FnOnce(SocketAddr, &str),
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    check_options(options)?;
    let name = model_name(options)?;
    if options.watch.is_some() && !options.model.join("LATEST").is_file() {
        return Err(ServeError::Setup(format!(
            "--watch: {} has no LATEST naming the newest export (watch checkpoint.dir/exports, which \
             checkpoint.export_every_steps writes)",
            options.model.display()
        )));
    }
    let served = Arc::new(Served::load(&options.model, name, options.overrides.clone())?);
    let running = Arc::new(AtomicBool::new(true));
    let health = match options.watch {
        None => None,
        Some(every) => {
            let health = Arc::new(WatchHealth::new(options.watch_unready_after));
            let (served, health, running) = (served.clone(), health.clone(), running.clone());
            let for_app = health.clone();
            std::thread::Builder::new()
                .name("sparrow-watch".into())
                .spawn(move || watch::watch(&served, &health, every, &running))
                .map_err(|e| ServeError::Setup(format!("starting the --watch thread: {e}")))?;
            Some(for_app)
        }
    };
    let _stop_watching = watch::StopOnDrop(running);
    let app = Arc::new(App {
        served: served.clone(),
        watch: health,
        limits: request::Limits {
            max_rows: options.max_batch_rows,
            max_inputs: served.input_columns(),
            max_ids: options.max_request_ids,
        },
        max_body_bytes: options.max_body_bytes,
        release_memory: options.release_memory,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| ServeError::Listen { addr: options.listen, source })?;
    let routes = router(app, options.max_body_bytes);
    let auth = options.auth.clone();
    let metrics = &served.metrics;
    let counters = connections::ConnectionCounters {
        open: metrics.connections_open.clone(),
        refused: metrics.connections_refused.clone(),
        evicted: metrics.connections_evicted.clone(),
        timed_out: metrics.connections_timed_out.clone(),
    };
    let (unauthorized, request_timeout) = (metrics.unauthorized.clone(), options.limits.request_timeout);
    let handle = move |request: hyper::Request<hyper::body::Incoming>| {
        let (routes, auth, unauthorized) = (routes.clone(), auth.clone(), unauthorized.clone());
        async move { answer(routes, &auth, &unauthorized, request_timeout, request).await }
    };
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|source| ServeError::Listen { addr: options.listen, source })?;
        let addr = listener.local_addr().map_err(|source| ServeError::Listen { addr: options.listen, source })?;
        on_listening(addr, served.name());
        connections::run(listener, handle, options.limits, counters, stop).await;
        Ok(())
    })
}

/// One request through the token check and the routes, within the request timeout.
async fn answer(
    mut routes: Router,
    auth: &Auth,
    unauthorized: &prometheus::IntCounter,
    timeout: Duration,
    request: hyper::Request<hyper::body::Incoming>,
) -> Response {
    use tower_service::Service;
    if !auth.admits(&request) {
        unauthorized.inc();
        let mut response = ApiError(
            StatusCode::UNAUTHORIZED,
            format!("missing or wrong token: send `Authorization: Bearer TOKEN` (the server's {TOKEN_ENV})"),
        )
        .into_response();
        response
            .headers_mut()
            .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        return response;
    }
    match tokio::time::timeout(timeout, routes.call(request)).await {
        Ok(Ok(response)) => response,
        Ok(Err(never)) => match never {},
        Err(_) => {
            let mut response = ApiError(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request took more than --request-timeout-ms ({} ms)", timeout.as_millis()),
            )
            .into_response();
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            response
        }
    }
}

/// Loads an export for serving (`sparrow serve`'s first step, for tests
/// and embedders): the model as `name`.
pub fn load(model: &Path, name: &str) -> Result<Served, ServeError> {
    Served::load(model, name.to_string(), sparrow_core::Overrides::none())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_are_url_segments() {
        for good in ["model", "ctr-v2", "a.b_c", "000000000008"] {
            assert!(valid_model_name(good), "{good}");
        }
        for bad in ["", "a/b", "..", ".", "a b", "a?b", "ä", &"x".repeat(129)] {
            assert!(!valid_model_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn off_loopback_a_token_or_no_auth() {
        let lo: SocketAddr = "127.0.0.1:8080".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:8080".parse().expect("addr");
        assert!(matches!(Auth::for_listen(lo, None, false), Ok(Auth::Open)));
        assert!(matches!(Auth::for_listen(lo, Some("t"), false), Ok(Auth::Token(_))));
        let refused = Auth::for_listen(any, None, false).expect_err("no token off loopback");
        assert!(refused.to_string().contains(TOKEN_ENV) && refused.to_string().contains("--no-auth"), "{refused}");
        assert!(Auth::for_listen(any, Some(""), false).is_err(), "an empty token is none");
        assert!(matches!(Auth::for_listen(any, Some("t"), false), Ok(Auth::Token(_))));
        assert!(matches!(Auth::for_listen(any, None, true), Ok(Auth::Open)));
    }
}
