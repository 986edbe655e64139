//! The server's connections: accepted up to a cap, each driven by hyper's
//! HTTP/1 with a watcher that closes it when a phase lasts too long, so no
//! client can hold the server by opening connections and sending nothing.
//!
//! A connection is in one phase at a time:
//! - **head**: from accept, or from the first byte after an idle spell,
//!   until a request's head is read: at most `header_read_timeout`;
//! - **busy**: from the request's head until its response is written (the
//!   body dropped by hyper): at most `request_timeout` (the handler answers
//!   408 at that time; the watcher closes a connection whose client does not
//!   take the reply a second later);
//! - **idle**: between a response and the next request's first byte: at most
//!   `idle_timeout`.
//!
//! At `max_connections`, a new connection closes the one that has waited
//! longest without a request in progress (head or idle) and takes its place;
//! with every connection busy, it is answered 503 and closed. Both are
//! counted, as are the timeouts by phase.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// A request's head (request line and headers) larger than this is refused.
const MAX_HEAD_BYTES: usize = 64 << 10;
/// How long a busy connection may go on after its request timed out (the
/// 408 being written) before it is closed.
const WRITE_GRACE: Duration = Duration::from_secs(1);
/// At shutdown, connections still busy after this long are closed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How many connections, and how long each phase of one may last.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub request_timeout: Duration,
}

/// What the connections count on `/metrics`.
#[derive(Clone)]
pub(crate) struct ConnectionCounters {
    pub open: IntGauge,
    pub refused: IntCounter,
    pub evicted: IntCounter,
    pub timed_out: IntCounterVec,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Head,
    Busy,
    Idle,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Phase::Head => "header",
            Phase::Busy => "request",
            Phase::Idle => "idle",
        }
    }
}

/// One connection's phase and the means to close it.
struct Conn {
    /// The phase and when it began.
    phase: parking_lot::Mutex<(Phase, Instant)>,
    /// Set when chosen for eviction (it no longer counts against the cap).
    evicted: AtomicBool,
    close: tokio::sync::Notify,
}

impl Conn {
    fn set(&self, phase: Phase) {
        *self.phase.lock() = (phase, Instant::now());
    }

    /// Bytes arrived: an idle connection starts a request's head.
    fn note_read(&self) {
        let mut phase = self.phase.lock();
        if phase.0 == Phase::Idle {
            *phase = (Phase::Head, Instant::now());
        }
    }

    /// The phase now and when it runs out.
    fn deadline(&self, limits: &ConnectionLimits) -> (Phase, Instant) {
        let (phase, since) = *self.phase.lock();
        let allowed = match phase {
            Phase::Head => limits.header_read_timeout,
            Phase::Busy => limits.request_timeout + WRITE_GRACE,
            Phase::Idle => limits.idle_timeout,
        };
        (phase, since + allowed)
    }
}

/// The open connections.
#[derive(Default)]
struct Registry {
    conns: parking_lot::Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    stopping: AtomicBool,
}

impl Registry {
    /// Room for one more: Ok, possibly after evicting the connection that
    /// has waited longest without a request; Err when every one is busy.
    fn admit(&self, max: usize, counters: &ConnectionCounters) -> Result<(u64, Arc<Conn>), ()> {
        let mut conns = self.conns.lock();
        let live = conns.values().filter(|c| !c.evicted.load(Ordering::SeqCst)).count();
        if live >= max {
            let victim = conns
                .values()
                .filter(|c| !c.evicted.load(Ordering::SeqCst))
                .map(|c| (c, *c.phase.lock()))
                .filter(|(_, (phase, _))| *phase != Phase::Busy)
                .min_by_key(|(_, (_, since))| *since)
                .map(|(c, _)| c.clone());
            let Some(victim) = victim else { return Err(()) };
            victim.evicted.store(true, Ordering::SeqCst);
            victim.close.notify_one();
            counters.evicted.inc();
        }
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let conn = Arc::new(Conn {
            phase: parking_lot::Mutex::new((Phase::Head, Instant::now())),
            evicted: AtomicBool::new(false),
            close: tokio::sync::Notify::new(),
        });
        conns.insert(id, conn.clone());
        Ok((id, conn))
    }

    fn remove(&self, id: u64) {
        self.conns.lock().remove(&id);
    }

    fn stop_all(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        for conn in self.conns.lock().values() {
            conn.close.notify_one();
        }
    }

    fn is_empty(&self) -> bool {
        self.conns.lock().is_empty()
    }
}

/// Accepts connections on `listener` and answers each request with
/// `handle` until `stop` resolves; then lets requests in progress finish
/// (up to [`SHUTDOWN_GRACE`]) and returns.
pub(crate) async fn run<H, F>(
    listener: TcpListener,
    handle: H,
    limits: ConnectionLimits,
    counters: ConnectionCounters,
    stop: impl Future<Output = ()>,
) where
    H: Fn(hyper::Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let registry = Arc::new(Registry::default());
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            () = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors and the like: the listener stays.
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok((id, conn)) = registry.admit(limits.max_connections, &counters) else {
            counters.refused.inc();
            // Best effort, never waiting on the client.
            let _ =
                stream.try_write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            continue;
        };
        let (registry, handle, counters) = (registry.clone(), handle.clone(), counters.clone());
        tokio::spawn(async move {
            counters.open.inc();
            drive(stream, conn, &registry, handle, limits, &counters).await;
            registry.remove(id);
            counters.open.dec();
        });
    }
    drop(listener);
    registry.stop_all();
    let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
    while !registry.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Serves one connection until it ends, runs out of time or is closed.
async fn drive<H, F>(
    stream: TcpStream,
    conn: Arc<Conn>,
    registry: &Registry,
    handle: H,
    limits: ConnectionLimits,
    counters: &ConnectionCounters,
) where
    H: Fn(hyper::Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = hyper::Response<Body>> + Send + 'static,
{
    let _ = stream.set_nodelay(true);
    let service_conn = conn.clone();
    let service = hyper::service::service_fn(move |request| {
        let (conn, handle) = (service_conn.clone(), handle.clone());
        async move {
            conn.set(Phase::Busy);
            let guard = IdleOnDrop(conn);
            let response = handle(request).await;
            Ok::<_, Infallible>(response.map(|body| Guarded { body, _guard: guard }))
        }
    });
    let http = http1::Builder::new()
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(100)
        .serve_connection(TokioIo::new(Tracked { stream, conn: conn.clone() }), service);
    tokio::pin!(http);
    loop {
        let (_, deadline) = conn.deadline(&limits);
        tokio::select! {
            _ = http.as_mut() => return,
            () = tokio::time::sleep_until(deadline.into()) => {
                let (phase, deadline) = conn.deadline(&limits);
                if Instant::now() >= deadline {
                    counters.timed_out.with_label_values(&[phase.label()]).inc();
                    return;
                }
            }
            () = conn.close.notified() => {
                if !registry.stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Shutdown: a request in progress finishes, an idle connection closes.
                http.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(SHUTDOWN_GRACE, http.as_mut()).await;
                return;
            }
        }
    }
}

/// The stream, noting when bytes arrive.
struct Tracked {
    stream: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Tracked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.note_read();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Marks the connection idle when dropped: hyper drops a response's body
/// once it is written (or the connection is gone).
struct IdleOnDrop(Arc<Conn>);

impl Drop for IdleOnDrop {
    fn drop(&mut self) {
        self.0.set(Phase::Idle);
    }
}

/// A response body that keeps its connection busy until it is dropped.
struct Guarded {
    body: Body,
    _guard: IdleOnDrop,
}

impl hyper::body::Body for Guarded {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
