use std::time::{Duration, Instant};

use peermem::{HostMemory, Provider};

use super::off_workers;

/// How late a 20 ms timer on the runtime's only worker fires while another task on that
/// worker runs `off_workers(p, ..)` over a 300 ms wait.
async fn timer_delay_beside(p: std::sync::Arc<dyn Provider + Send + Sync>) -> Duration {
    let (started, is_started) = tokio::sync::oneshot::channel();
    let ticker = tokio::spawn(async move {
        let t = Instant::now();
        let _ = started.send(());
        tokio::time::sleep(Duration::from_millis(20)).await;
        t.elapsed()
    });
    is_started.await.unwrap();
    let copy = tokio::spawn(async move {
        off_workers(&*p, || std::thread::sleep(Duration::from_millis(300)));
    });
    let late = ticker.await.unwrap();
    copy.await.unwrap();
    late
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_copy_that_waits_on_a_device_holds_up_no_other_task() {
    let path = std::env::temp_dir().join(format!("p2p-rdma-off-workers-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; 4096]).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mapped = HostMemory::file(&file, false).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(
        mapped.copies_wait(),
        "a mapped file faults pages in from its disk"
    );
    let late = timer_delay_beside(std::sync::Arc::new(mapped)).await;
    assert!(
        late < Duration::from_millis(200),
        "the timer fired after {late:?}"
    );
    // memory copies run in place: the same wait holds the worker (the measure above can fail)
    let ram = HostMemory::anonymous(4096, false).unwrap();
    assert!(!ram.copies_wait());
    let late = timer_delay_beside(std::sync::Arc::new(ram)).await;
    assert!(
        late >= Duration::from_millis(250),
        "the timer fired after {late:?}"
    );
}
