//! What every connection and listener of a role needs, whatever carries
//! it (the gRPC transport, the metrics endpoint): the shared token, message
//! caps, timeouts, and the rule that only loopback may listen without a token.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::transport::ClusterError;

/// The environment variable that carries the shared token (overrides
/// `cluster.auth_token`). The binary reads it; `launch` sets it for its children.
pub const TOKEN_ENV: &str = "SPARROW_AUTH_TOKEN";

/// What every connection and listener of a role needs.
#[derive(Clone)]
pub struct NetSettings {
    pub token: Option<Arc<str>>,
    pub max_message_bytes: usize,
    pub connect_timeout: Duration,
    /// A call unanswered this long fails (a stopped peer cannot hang its
    /// callers): twice the heartbeat timeout.
    pub rpc_timeout: Duration,
}

impl NetSettings {
    /// From the cluster config; `token` (the process's own, from [`TOKEN_ENV`])
    /// takes precedence over `cluster.auth_token`.
    pub fn new(cluster: &sparrow_core::config::ClusterConfig, token: Option<&str>) -> NetSettings {
        let token = token.or(cluster.auth_token.as_deref()).filter(|t| !t.is_empty()).map(str::to_owned);
        NetSettings {
            token: token.map(Arc::from),
            max_message_bytes: cluster.max_message_bytes,
            connect_timeout: Duration::from_millis(cluster.connect_timeout_ms),
            rpc_timeout: Duration::from_millis(2 * cluster.heartbeat_timeout_ms),
        }
    }

    /// Refuses a listener off loopback without a token.
    pub fn check_listen(&self, addr: SocketAddr) -> Result<(), ClusterError> {
        if !addr.ip().is_loopback() && self.token.is_none() {
            return Err(ClusterError::Setup(format!(
                "refusing to listen on {addr} without a shared token: set cluster.auth_token or {TOKEN_ENV} \
                 (only loopback addresses may run without one)"
            )));
        }
        Ok(())
    }
}
