//! The TCP data path on the server: a client without an RDMA device reads and writes a region
//! over its control connection (`TcpRead` / `TcpWrite`, checked by the session), through the
//! region's copy engine. At most one chunk (`bounce_chunk`) per request is buffered.

use crate::conn::Conn;
use crate::error::Result;
use crate::metrics::{Direction, XferPath};
use crate::protocol::{DataPath, ErrorCode, Msg};

use super::bounce::on_memory;
use super::session::{Refusal, Step};
use super::Shared;

/// Carry out a TCP data step. `Ok(None)`: the reply (and its data) went out already;
/// `Ok(Some(reply))`: send it; `Err`: the connection is broken.
pub(super) async fn serve<T>(
    shared: &Shared,
    client: &str,
    conn: &mut Conn,
    step: Step<T>,
) -> Result<Option<Msg>> {
    let m = shared.metrics();
    match step {
        Step::TcpRead {
            region,
            offset,
            len,
        } => {
            let started = std::time::Instant::now();
            match read(shared, region, offset, len).await {
                Ok(data) => {
                    let reply = Msg::TcpData { len };
                    super::driver::count_reply(m, &reply);
                    conn.send_with(&reply, &data).await?;
                    let name = &shared.regions.get(region).info.name;
                    m.transfer(name, Direction::fetch, XferPath::tcp, len);
                    m.observe(
                        Direction::fetch,
                        XferPath::tcp,
                        started.elapsed().as_secs_f64(),
                    );
                    Ok(None)
                }
                Err((code, message)) => Ok(Some(Msg::Error { code, message })),
            }
        }
        Step::TcpWrite {
            region,
            offset,
            len,
        } => {
            let started = std::time::Instant::now();
            let data = conn
                .recv_payload(len as usize, Some(shared.cfg.idle_timeout))
                .await?;
            match write(shared, region, offset, data).await {
                Ok(()) => {
                    let name = shared.regions.get(region).info.name.clone();
                    m.transfer(&name, Direction::put, XferPath::tcp, len);
                    m.observe(
                        Direction::put,
                        XferPath::tcp,
                        started.elapsed().as_secs_f64(),
                    );
                    shared.notices.put(super::PutNotice {
                        region: name,
                        offset,
                        len,
                        client: client.to_string(),
                        path: DataPath::Tcp,
                    });
                    Ok(Some(Msg::TcpWritten { len }))
                }
                Err((code, message)) => Ok(Some(Msg::Error { code, message })),
            }
        }
        Step::Skip { len, reply } => {
            // the refused request's bytes: read and dropped, so the next frame is in step
            conn.recv_payload(len as usize, Some(shared.cfg.idle_timeout))
                .await?;
            Ok(Some(reply))
        }
        _ => Ok(Some(Msg::error(
            ErrorCode::Internal,
            "a step that is not a TCP data step reached the TCP data path",
        ))),
    }
}

async fn read(
    shared: &Shared,
    region: usize,
    offset: u64,
    len: u64,
) -> std::result::Result<Vec<u8>, Refusal> {
    on_memory(
        shared,
        region,
        || format!("reading {len} bytes at {offset}"),
        move |p| {
            let mut data = vec![0u8; len as usize];
            p.copy_out(offset, &mut data).map(|()| data)
        },
    )
    .await
}

async fn write(
    shared: &Shared,
    region: usize,
    offset: u64,
    data: Vec<u8>,
) -> std::result::Result<(), Refusal> {
    let len = data.len();
    on_memory(
        shared,
        region,
        || format!("writing {len} bytes at {offset}"),
        move |p| p.copy_in(offset, &data),
    )
    .await
}
