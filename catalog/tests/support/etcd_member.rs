//! A single etcd member on 127.0.0.1 for the tests (Debian's etcd-server: `/usr/bin/etcd`),
//! in a temporary data directory, stopped and removed on drop.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) struct Etcd {
    child: Option<Child>,
    pub(crate) port: u16,
    peer: u16,
    pub(crate) dir: PathBuf,
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
        let dir =
            std::env::temp_dir().join(format!("p2p-etcd-{}-{}", std::process::id(), free_port()));
        let mut e = Etcd {
            child: None,
            port: free_port(),
            peer: free_port(),
            dir,
        };
        e.launch();
        e
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub(crate) fn url(&self, prefix: &str) -> catalog::CatalogUrl {
        format!("etcd://{}/{prefix}", self.endpoint())
            .parse()
            .unwrap()
    }

    /// Start the member (again, on the same ports and data).
    pub(crate) fn launch(&mut self) {
        let (c, p) = (self.port, self.peer);
        let child = Command::new(etcd_binary())
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args([
                &format!("--listen-client-urls=http://127.0.0.1:{c}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{c}"),
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
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", c)) {
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
                "etcd did not become healthy on port {c} within 30 s"
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
