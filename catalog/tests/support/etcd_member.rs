//! A single etcd member on 127.0.0.1 for the tests (Debian's etcd-server: `/usr/bin/etcd`),
//! in a temporary data directory, stopped and removed on drop; optionally serving clients over
//! TLS with certificates made by `openssl` (a CA, the member's, and a client's).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct Etcd {
    child: Option<Child>,
    pub(crate) port: u16,
    peer: u16,
    /// Plain HTTP /health (the client port speaks TLS when `tls` is set).
    metrics: u16,
    pub(crate) dir: PathBuf,
    pub(crate) tls: Option<Pki>,
}

/// Certificates for a TLS member: `ca` signed `server` (for IP 127.0.0.1) and `client`.
#[allow(dead_code)]
pub(crate) struct Pki {
    pub(crate) ca: PathBuf,
    pub(crate) server: (PathBuf, PathBuf),
    pub(crate) client: (PathBuf, PathBuf),
    /// A client certificate from another CA, which the member must refuse.
    pub(crate) stranger: (PathBuf, PathBuf),
}

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run openssl ({e}): the TLS tests make their certificates with it (Debian package openssl)")
        });
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    fn make(dir: &std::path::Path) -> Pki {
        std::fs::create_dir_all(dir).unwrap();
        let ca = |name: &str| {
            openssl(
                dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    &format!("/CN={name}"),
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.pem"),
                ],
            );
        };
        let leaf = |name: &str, ca: &str, ext: &str| {
            openssl(
                dir,
                &[
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-subj",
                    &format!("/CN={name}"),
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.csr"),
                ],
            );
            std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &format!("{name}.csr"),
                    "-CA",
                    &format!("{ca}.pem"),
                    "-CAkey",
                    &format!("{ca}.key"),
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-extfile",
                    &format!("{name}.ext"),
                    "-out",
                    &format!("{name}.pem"),
                ],
            );
        };
        ca("ca");
        ca("otherca");
        leaf(
            "server",
            "ca",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        leaf("client", "ca", "extendedKeyUsage=clientAuth\n");
        leaf("stranger", "otherca", "extendedKeyUsage=clientAuth\n");
        let pair = |n: &str| (dir.join(format!("{n}.pem")), dir.join(format!("{n}.key")));
        Pki {
            ca: dir.join("ca.pem"),
            server: pair("server"),
            client: pair("client"),
            stranger: pair("stranger"),
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn etcd_binary() -> PathBuf {
    let p = PathBuf::from(std::env::var("P2P_ETCD").unwrap_or_else(|_| "/usr/bin/etcd".into()));
    assert!(
        p.exists(),
        "{} is missing: these tests run a real etcd member (Debian package etcd-server; \
         scripts/install-deps installs it, or set P2P_ETCD to its path)",
        p.display()
    );
    p
}

impl Etcd {
    pub(crate) fn start() -> Etcd {
        Self::new(false)
    }

    /// A member whose clients must speak TLS and show a certificate signed by its CA.
    #[allow(dead_code)]
    pub(crate) fn start_tls() -> Etcd {
        Self::new(true)
    }

    fn new(tls: bool) -> Etcd {
        let dir =
            std::env::temp_dir().join(format!("p2p-etcd-{}-{}", std::process::id(), free_port()));
        let tls = tls.then(|| Pki::make(&dir.join("pki")));
        let mut e = Etcd {
            child: None,
            port: free_port(),
            peer: free_port(),
            metrics: free_port(),
            dir,
            tls,
        };
        e.launch();
        e
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub(crate) fn url(&self, prefix: &str) -> catalog::CatalogUrl {
        let scheme = if self.tls.is_some() { "etcds" } else { "etcd" };
        format!("{scheme}://{}/{prefix}", self.endpoint())
            .parse()
            .unwrap()
    }

    /// Start the member (again, on the same ports and data).
    pub(crate) fn launch(&mut self) {
        let (c, p, m) = (self.port, self.peer, self.metrics);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut cmd = Command::new(etcd_binary());
        if let Some(pki) = &self.tls {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&pki.ca)
                .arg("--cert-file")
                .arg(&pki.server.0)
                .arg("--key-file")
                .arg(&pki.server.1);
        }
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.join("data"))
            .args([
                &format!("--listen-client-urls={scheme}://127.0.0.1:{c}"),
                &format!("--advertise-client-urls={scheme}://127.0.0.1:{c}"),
                &format!("--listen-metrics-urls=http://127.0.0.1:{m}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{p}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{p}"),
                &format!("--initial-cluster=t=http://127.0.0.1:{p}"),
                "--log-level=error",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot run etcd");
        self.child = Some(child);
        // ready when /health says so
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", m)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(b"GET /health HTTP/1.0\r\n\r\n");
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                if out.contains("\"health\":\"true\"") {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy on port {c} within 30 s (health on {m})"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kill the member (SIGKILL), keeping its data.
    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
