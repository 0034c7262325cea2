//! The operator's HTTP endpoint: `/metrics` (OpenMetrics text), `/healthz` (the process
//! answers), `/readyz` (every region proved and the control listener up).
//!
//! Deliberately small: HTTP/1.x GET and HEAD, one request per connection, the request head
//! bounded in bytes and time, a bounded number of connections at once. Request parsing is a
//! pure function ([`route`]) that the tests drive with hostile input.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Largest request head accepted.
pub const MAX_HEAD: usize = 8 << 10;
/// How long a client may take to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more wait in the kernel's backlog.
pub const MAX_CONNECTIONS: usize = 32;

/// A response: status line, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// e.g. 200.
    pub status: u16,
    /// Reason phrase.
    pub reason: &'static str,
    /// Content-Type.
    pub content_type: &'static str,
    /// Body (omitted for HEAD).
    pub body: String,
    /// Whether to send the body.
    pub head_only: bool,
}

impl Response {
    fn text(status: u16, reason: &'static str, body: impl Into<String>) -> Response {
        Response {
            status,
            reason,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
            head_only: false,
        }
    }

    /// The bytes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.status,
            self.reason,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        if !self.head_only {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

/// Answer a complete request head (everything up to and including the blank line).
pub fn route(head: &[u8], metrics: &Metrics) -> Response {
    let Ok(text) = std::str::from_utf8(head) else {
        return Response::text(400, "Bad Request", "request head is not UTF-8\n");
    };
    let line = text.split("\r\n").next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Response::text(400, "Bad Request", "malformed request line\n");
    };
    if !version.starts_with("HTTP/1.") {
        return Response::text(505, "HTTP Version Not Supported", "HTTP/1.x only\n");
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Response::text(405, "Method Not Allowed", "GET or HEAD only\n"),
    };
    let path = target.split('?').next().unwrap_or("");
    let mut r = match path {
        "/metrics" => Response {
            status: 200,
            reason: "OK",
            content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
            body: metrics.encode(),
            head_only: false,
        },
        "/healthz" => Response::text(200, "OK", "ok\n"),
        "/readyz" if metrics.is_ready() => Response::text(200, "OK", "ready\n"),
        "/readyz" => Response::text(
            503,
            "Service Unavailable",
            "not ready: regions are being proved (canaries) or the listener is not up\n",
        ),
        _ => Response::text(404, "Not Found", "try /metrics, /healthz or /readyz\n"),
    };
    r.head_only = head_only;
    r
}

/// Where a complete head ends in `buf` (index past the blank line), if it does yet.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// A bound metrics listener.
#[derive(Debug)]
pub struct MetricsServer {
    listener: TcpListener,
    metrics: Arc<Metrics>,
}

impl MetricsServer {
    /// Bind `addr`.
    pub async fn bind(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<MetricsServer> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io(format!("cannot listen for metrics on {addr}"), e))?;
        Ok(MetricsServer { listener, metrics })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| Error::io("metrics listener address", e))
    }

    /// Serve forever (drop the future to stop).
    pub async fn run(self) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
                return;
            };
            let (mut stream, peer) = match self.listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let metrics = Arc::clone(&self.metrics);
            tokio::spawn(async move {
                let _permit = permit;
                let mut buf = Vec::with_capacity(1024);
                let read = async {
                    let mut chunk = [0u8; 1024];
                    loop {
                        if let Some(end) = head_end(&buf) {
                            return Some(end);
                        }
                        if buf.len() >= MAX_HEAD {
                            return None;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return None,
                            Ok(n) => buf.extend_from_slice(&chunk[..n.min(MAX_HEAD - buf.len())]),
                        }
                    }
                };
                let resp = match tokio::time::timeout(HEAD_TIMEOUT, read).await {
                    Ok(Some(end)) => route(&buf[..end], &metrics),
                    Ok(None) if buf.len() >= MAX_HEAD => Response::text(
                        431,
                        "Request Header Fields Too Large",
                        "request head too large\n",
                    ),
                    Ok(None) => return,
                    Err(_) => Response::text(408, "Request Timeout", "request head too slow\n"),
                };
                tracing::debug!(%peer, status = resp.status, "metrics request");
                let _ =
                    tokio::time::timeout(HEAD_TIMEOUT, stream.write_all(&resp.to_bytes())).await;
                let _ = stream.shutdown().await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let m = Metrics::new();
        let get = |p: &str| {
            route(
                format!("GET {p} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
                &m,
            )
        };
        assert_eq!(get("/healthz").status, 200);
        assert_eq!(get("/readyz").status, 503);
        m.set_ready(true);
        assert_eq!(get("/readyz").status, 200);
        let r = get("/metrics?x=1");
        assert_eq!(r.status, 200);
        assert!(r.content_type.starts_with("application/openmetrics-text"));
        assert!(r.body.contains("p2p_rdma_ready 1"));
        assert_eq!(get("/nope").status, 404);
        let head = route(b"HEAD /healthz HTTP/1.0\r\n\r\n", &m);
        assert_eq!(head.status, 200);
        assert!(String::from_utf8(head.to_bytes())
            .unwrap()
            .ends_with("\r\n\r\n"));
        for (bad, status) in [
            (&b"POST /metrics HTTP/1.1\r\n\r\n"[..], 405),
            (b"GET /metrics\r\n\r\n", 400),
            (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
            (b"GET  /metrics HTTP/1.1\r\n\r\n", 400),
            (b"\xff\xfe\r\n\r\n", 400),
            (b"\r\n\r\n", 400),
        ] {
            assert_eq!(route(bad, &m).status, status, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn serves_over_tcp_and_refuses_oversized_heads() {
        let m = Arc::new(Metrics::new());
        let s = MetricsServer::bind("127.0.0.1:0".parse().unwrap(), Arc::clone(&m))
            .await
            .unwrap();
        let addr = s.local_addr().unwrap();
        let task = tokio::spawn(s.run());
        let ask = |req: Vec<u8>| async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let _ = c.write_all(&req).await;
            let mut out = String::new();
            let _ = c.read_to_string(&mut out).await;
            out
        };
        let r = ask(b"GET /healthz HTTP/1.1\r\n\r\n".to_vec()).await;
        assert!(
            r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("ok\n"),
            "{r}"
        );
        let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD, b'a');
        let r = ask(big).await;
        assert!(r.starts_with("HTTP/1.1 431"), "{r}");
        task.abort();
    }
}
