//! The connection's protocol rules, driven on the host with a fake region table.

use super::*;

use crate::server::testkit::{Fake, ENDPOINT, RULES};
use crate::token::Token;

mod any_sequence;
mod first;

fn fake() -> Fake {
    Fake::new()
}

fn code<T: std::fmt::Debug>(s: Step<T>) -> ErrorCode {
    match s {
        Step::Reply(Msg::Error { code, .. }) => code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn message<T: std::fmt::Debug>(s: Step<T>) -> String {
    match s {
        Step::Reply(Msg::Error { message, .. }) => message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Open `name` through the session as the driver would, with payload `p`.
fn open(s: &mut Session<u32>, c: &Fake, name: &str, write: bool, p: u32) -> u32 {
    match s.step(
        Msg::Open {
            region: name.into(),
            write,
            first: None,
        },
        c,
    ) {
        Step::Open {
            region, writable, ..
        } => s.opened(region, writable, c.direct[region], true, p),
        other => panic!("open {name}: {other:?}"),
    }
}

fn bounce(handle: u32, offset: u64, len: u64, to_region: bool) -> Msg {
    Msg::Bounce {
        handle,
        offset,
        len,
        to_region,
        addr: 0x1000,
        rkey: 7,
    }
}

/// Connect a QP through the session as the driver would.
fn connect(s: &mut Session<u32>, c: &Fake) {
    assert!(matches!(
        s.step(
            Msg::Connect {
                endpoint: ENDPOINT,
                nic: None,
            },
            c
        ),
        Step::Connect(..)
    ));
    s.connected();
}

fn connected(c: &Fake) -> Session<u32> {
    let mut s = Session::new(RULES, Scope::All);
    connect(&mut s, c);
    assert_eq!(
        code(s.step(
            Msg::Connect {
                endpoint: ENDPOINT,
                nic: None,
            },
            c
        )),
        ErrorCode::BadRequest,
        "a second QP"
    );
    s
}

#[test]
fn the_hello_checks_kind_version_and_token() {
    let t = [Grant::all("secret")];
    let hello = |version, token: &str| Msg::Hello {
        version,
        token: Token::new(token),
        client: "c1".into(),
    };
    assert_eq!(
        check_hello(hello(VERSION, "secret"), &t).unwrap(),
        ("c1".to_string(), Scope::All)
    );
    let e = check_hello(Msg::List, &t).unwrap_err();
    assert_eq!(
        (e.code, e.fault),
        (ErrorCode::Unauthorized, HelloFault::NotHello("list"))
    );
    let e = check_hello(hello(VERSION + 1, "secret"), &t).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadVersion);
    assert!(e.message.contains("use matching p2p-rdma versions"));
    let e = check_hello(hello(VERSION, "secreT"), &t).unwrap_err();
    assert_eq!(
        (e.code, e.fault),
        (ErrorCode::Unauthorized, HelloFault::Token("c1".into()))
    );
    assert!(!e.message.contains("secret"), "{}", e.message);
    let e = check_hello(hello(VERSION, ""), &t).unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthorized);
}

#[test]
fn opens_are_checked_and_bounded() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let m = message(s.step(
        Msg::Open {
            region: "nope".into(),
            write: false,
            first: None,
        },
        &c,
    ));
    assert!(m.contains("it serves: rw, ro"), "{m}");
    assert_eq!(
        code(s.step(
            Msg::Open {
                region: "gone".into(),
                write: false,
                first: None,
            },
            &c
        )),
        ErrorCode::UnknownRegion,
        "a removed region cannot be opened"
    );
    assert_eq!(
        code(s.step(
            Msg::Open {
                region: "ro".into(),
                write: true,
                first: None,
            },
            &c
        )),
        ErrorCode::ReadOnly
    );
    let hs: Vec<u32> = (0..4)
        .map(|i| open(&mut s, &c, "rw", i % 2 == 0, i))
        .collect();
    let mut unique = hs.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), 4, "handles are distinct: {hs:?}");
    assert_eq!(
        code(s.step(
            Msg::Open {
                region: "ro".into(),
                write: false,
                first: None,
            },
            &c
        )),
        ErrorCode::Busy,
        "the fifth open is over the limit"
    );
    assert_eq!(s.open_count(), 4);
}

#[test]
fn a_closed_handle_stays_closed_even_when_its_slot_is_reused() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let a = open(&mut s, &c, "rw", false, 10);
    let b = open(&mut s, &c, "rw", false, 11);
    match s.step(Msg::Close { handle: a }, &c) {
        Step::Close {
            handle,
            region,
            payload,
            last,
        } => {
            assert_eq!((handle, region, payload), (a, 0, 10));
            assert!(!last, "b still uses the region");
        }
        other => panic!("{other:?}"),
    }
    // the slot of `a` is reused, under another number
    let d = open(&mut s, &c, "ro", false, 12);
    assert_ne!(d, a);
    assert_eq!(
        code(s.step(Msg::Close { handle: a }, &c)),
        ErrorCode::NotOpen
    );
    assert_eq!(
        code(s.step(bounce(a, 0, 1, false), &c)),
        ErrorCode::NotOpen,
        "a stale handle does not reach the region now in its slot"
    );
    match s.step(Msg::Close { handle: b }, &c) {
        Step::Close { last, payload, .. } => assert!(last && payload == 11),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.region_of(d), Some(1));
}

#[test]
fn bounce_requests_are_checked_in_order() {
    let c = fake();
    let mut s = Session::new(RULES, Scope::All);
    let rw = open(&mut s, &c, "rw", false, 0);
    assert_eq!(
        code(s.step(bounce(rw, 64 << 10, 4096, false), &c)),
        ErrorCode::BadRequest,
        "no QP yet"
    );
    let mut s = connected(&c);
    let rw = open(&mut s, &c, "rw", false, 0);
    let rww = open(&mut s, &c, "rw", true, 1);
    let ro = open(&mut s, &c, "ro", false, 2);
    let base = 64u64 << 10;
    assert_eq!(
        code(s.step(bounce(99, base, 1, false), &c)),
        ErrorCode::NotOpen
    );
    assert_eq!(
        code(s.step(bounce(rw, 0, 4096, false), &c)),
        ErrorCode::NotBounce,
        "the direct part goes by one-sided RDMA"
    );
    for (off, len) in [(1 << 20, 1), (u64::MAX, 2), ((1 << 20) - 1, 2)] {
        assert_eq!(
            code(s.step(bounce(rw, off, len, false), &c)),
            ErrorCode::OutOfRange,
            "{off}+{len}"
        );
    }
    assert_eq!(
        code(s.step(bounce(rw, base, 0, false), &c)),
        ErrorCode::BadRequest
    );
    assert_eq!(
        code(s.step(bounce(rw, base, (1 << 16) + 1, false), &c)),
        ErrorCode::BadRequest,
        "over the chunk"
    );
    assert_eq!(
        code(s.step(bounce(ro, 0, 1, true), &c)),
        ErrorCode::ReadOnly
    );
    let m = message(s.step(bounce(rw, base, 1, true), &c));
    assert!(m.contains("opened for reading"), "{m}");
    match s.step(bounce(rww, base, 1 << 16, true), &c) {
        Step::Bounce(b) => assert_eq!(
            (b.region, b.offset, b.len, b.to_region, b.rkey),
            (0, base, 1 << 16, true, 7)
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        s.step(bounce(ro, (1 << 20) - 1, 1, false), &c),
        Step::Bounce(_)
    ));
}

#[test]
fn a_removed_region_refuses_bounces_and_reports() {
    let mut c = fake();
    let mut s = connected(&c);
    let h = open(&mut s, &c, "rw", true, 0);
    c.removed[0] = true;
    assert_eq!(
        code(s.step(bounce(h, 1 << 17, 1, false), &c)),
        ErrorCode::Removed
    );
    assert!(matches!(
        s.step(
            Msg::Transferred {
                handle: h,
                offset: 0,
                len: 1,
                to_region: false,
                micros: 1
            },
            &c
        ),
        Step::Ignore
    ));
}

#[test]
fn reports_count_only_the_direct_part_of_an_open_handle() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let r = open(&mut s, &c, "rw", false, 0);
    let w = open(&mut s, &c, "rw", true, 0);
    let report = |handle, offset, len, to_region| Msg::Transferred {
        handle,
        offset,
        len,
        to_region,
        micros: 5,
    };
    assert!(matches!(
        s.step(report(r, 0, 64 << 10, false), &c),
        Step::Report {
            region: 0,
            offset: 0,
            len: 65536,
            to_region: false,
            micros: 5
        }
    ));
    for bad in [
        report(r, 1, 64 << 10, false),
        report(r, u64::MAX, 2, false),
        report(r, 0, 1, true),
        report(1234, 0, 1, false),
    ] {
        assert!(matches!(s.step(bad, &c), Step::Ignore));
    }
    assert!(matches!(
        s.step(report(w, 0, 1, true), &c),
        Step::Report { .. }
    ));
}

#[test]
fn draining_refuses_opens_and_lets_an_idle_client_go() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let h = open(&mut s, &c, "rw", false, 0);
    s.drain();
    assert!(!s.may_leave(), "it holds a handle");
    assert_eq!(
        code(s.step(
            Msg::Open {
                region: "rw".into(),
                write: false,
                first: None,
            },
            &c
        )),
        ErrorCode::ShuttingDown
    );
    assert!(matches!(
        s.step(
            Msg::Checksum {
                handle: h,
                offset: 0,
                len: 1
            },
            &c
        ),
        Step::Checksum { .. }
    ));
    assert!(matches!(
        s.step(Msg::Close { handle: h }, &c),
        Step::Close { .. }
    ));
    assert!(s.may_leave());
}

#[test]
fn server_messages_and_a_second_hello_are_refused() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    for m in [
        Msg::Hello {
            version: VERSION,
            token: Token::new("x"),
            client: "c".into(),
        },
        Msg::Closed { handle: 1 },
        Msg::BounceDone {
            len: 1,
            zero_copy: 0,
        },
        Msg::error(ErrorCode::Internal, "x"),
    ] {
        let m = message(s.step(m, &c));
        assert!(m.contains("is not a request a client may send now"), "{m}");
    }
    assert!(matches!(s.step(Msg::Bye, &c), Step::Leave));
    assert!(matches!(s.step(Msg::List, &c), Step::List));
}

#[test]
fn checksums_check_the_handle_and_the_range() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let h = open(&mut s, &c, "ro", false, 0);
    assert_eq!(
        code(s.step(
            Msg::Checksum {
                handle: h + 1,
                offset: 0,
                len: 1
            },
            &c
        )),
        ErrorCode::NotOpen
    );
    assert_eq!(
        code(s.step(
            Msg::Checksum {
                handle: h,
                offset: 1,
                len: 1 << 20
            },
            &c
        )),
        ErrorCode::OutOfRange
    );
}

#[test]
fn flushes_need_a_handle_opened_for_writing_and_a_range_inside() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let r = open(&mut s, &c, "rw", false, 0);
    let w = open(&mut s, &c, "rw", true, 0);
    let flush = |handle, offset, len| Msg::Flush {
        handle,
        offset,
        len,
    };
    assert_eq!(code(s.step(flush(r, 0, 1), &c)), ErrorCode::ReadOnly);
    assert_eq!(code(s.step(flush(77, 0, 1), &c)), ErrorCode::NotOpen);
    assert_eq!(
        code(s.step(flush(w, 1, 1 << 20), &c)),
        ErrorCode::OutOfRange
    );
    assert!(matches!(
        s.step(flush(w, 5, 10), &c),
        Step::Flush {
            region: 0,
            offset: 5,
            len: 10
        }
    ));
}

#[test]
fn a_region_that_holds_data_takes_puts_over_its_direct_part_through_the_server() {
    let mut c = fake();
    c.infos[0].server_puts = true;
    let mut s = connected(&c);
    let w = open(&mut s, &c, "rw", true, 0);
    assert!(matches!(
        s.step(bounce(w, 0, 4096, true), &c),
        Step::Bounce(_)
    ));
    assert_eq!(
        code(s.step(bounce(w, 0, 4096, false), &c)),
        ErrorCode::NotBounce,
        "fetches of the direct part still use the rkey"
    );
}

#[test]
fn keepalives_need_no_reply() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    assert!(matches!(s.step(Msg::KeepAlive, &c), Step::Ignore));
}

#[test]
fn a_scoped_token_sees_and_writes_only_what_it_grants() {
    let c = fake();
    let grants = [
        Grant::all("admin"),
        Grant {
            token: Token::new("reader"),
            scope: Scope::Regions(vec![("rw".into(), false), ("held".into(), true)]),
        },
    ];
    let hello = Msg::Hello {
        version: VERSION,
        token: Token::new("reader"),
        client: "r".into(),
    };
    let (_, scope) = check_hello(hello, &grants).unwrap();
    let mut s: Session<u32> = Session::new(RULES, scope);
    let m = message(s.step(
        Msg::Open {
            region: "ro".into(),
            write: false,
            first: None,
        },
        &c,
    ));
    assert!(
        m.contains("no region 'ro'") && m.contains("it serves: rw, held") && !m.contains("ro,"),
        "a region outside the scope is not there: {m}"
    );
    assert_eq!(
        code(s.step(
            Msg::Open {
                region: "rw".into(),
                write: true,
                first: None,
            },
            &c
        )),
        ErrorCode::Unauthorized
    );
    open(&mut s, &c, "rw", false, 0);
    open(&mut s, &c, "held", true, 0);
}

#[test]
fn tcp_data_needs_an_open_handle_and_a_range_of_one_chunk_but_no_qp() {
    let c = fake();
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    let rw = open(&mut s, &c, "rw", true, 0);
    let ro = open(&mut s, &c, "ro", false, 1);
    let read = |handle, offset, len| Msg::TcpRead {
        handle,
        offset,
        len,
    };
    let write = |handle, offset, len| Msg::TcpWrite {
        handle,
        offset,
        len,
    };
    // the direct part too, and without a QP: the bytes travel on this connection
    assert!(matches!(
        s.step(read(rw, 0, 4096), &c),
        Step::TcpRead {
            region: 0,
            offset: 0,
            len: 4096
        }
    ));
    assert!(matches!(
        s.step(write(rw, 100, 64 << 10), &c),
        Step::TcpWrite { region: 0, .. }
    ));
    assert_eq!(
        code(s.step(read(rw, (1 << 20) - 1, 2), &c)),
        ErrorCode::OutOfRange
    );
    assert!(message(s.step(read(rw, 0, RULES.bounce_chunk + 1), &c)).contains("1 to"));
    assert_eq!(code(s.step(read(rw, 0, 0), &c)), ErrorCode::BadRequest);
    assert_eq!(code(s.step(read(99, 0, 1), &c)), ErrorCode::NotOpen);
    // a refused write whose bytes follow on the wire: they are dropped, then the refusal
    match s.step(write(ro, 0, 10), &c) {
        Step::Skip {
            len: 10,
            reply: Msg::Error { code, .. },
        } => assert_eq!(code, ErrorCode::ReadOnly),
        other => panic!("{other:?}"),
    }
    let rw_for_reading = open(&mut s, &c, "rw", false, 2);
    assert!(matches!(
        s.step(write(rw_for_reading, 0, 10), &c),
        Step::Skip { len: 10, .. }
    ));
    // more bytes than any request may carry are not read: the connection breaks on them
    assert_eq!(
        code(s.step(write(ro, 0, RULES.bounce_chunk + 1), &c)),
        ErrorCode::BadRequest
    );
}

#[test]
fn locate_names_the_regions_nic_and_hides_what_the_token_does_not_grant() {
    let mut c = fake();
    c.infos[0].nic = Some("rxe1".into());
    let locate = |s: &mut Session<u32>, name: &str| {
        s.step(
            Msg::Locate {
                region: name.into(),
            },
            &c,
        )
    };
    let mut s: Session<u32> = Session::new(RULES, Scope::All);
    match locate(&mut s, "rw") {
        Step::Reply(Msg::Located { nic }) => assert_eq!(nic.as_deref(), Some("rxe1")),
        other => panic!("{other:?}"),
    }
    match locate(&mut s, "ro") {
        Step::Reply(Msg::Located { nic }) => assert_eq!(nic, None, "a one-NIC region"),
        other => panic!("{other:?}"),
    }
    assert_eq!(code(locate(&mut s, "gone")), ErrorCode::UnknownRegion);
    let mut s: Session<u32> = Session::new(RULES, Scope::Regions(vec![("ro".into(), false)]));
    let m = message(locate(&mut s, "rw"));
    assert!(
        m.contains("no region 'rw'") && !m.contains("held"),
        "a region the token does not grant is not there: {m}"
    );
}

#[test]
fn a_handle_opened_without_a_direct_part_bounces_every_byte() {
    // the driver opens a region whose MR is on another NIC than the QP with no direct part
    let c = fake();
    let mut s = connected(&c);
    let region = match s.step(
        Msg::Open {
            region: "rw".into(),
            write: true,
            first: None,
        },
        &c,
    ) {
        Step::Open { region, .. } => region,
        other => panic!("{other:?}"),
    };
    let h = s.opened(region, true, 0, false, 0);
    let direct = open(&mut s, &c, "rw", true, 1);
    assert!(matches!(
        s.step(bounce(h, 0, 4096, true), &c),
        Step::Bounce(_)
    ));
    assert_eq!(
        code(s.step(bounce(direct, 0, 4096, true), &c)),
        ErrorCode::NotBounce,
        "the other handle of the same region has its direct part"
    );
    // a report of one-sided bytes on a handle without a direct part counts nothing
    let report = |handle| Msg::Transferred {
        handle,
        offset: 0,
        len: 4096,
        to_region: true,
        micros: 1,
    };
    assert!(matches!(s.step(report(h), &c), Step::Ignore));
    assert!(matches!(s.step(report(direct), &c), Step::Report { .. }));
}

#[test]
fn staged_fetches_take_free_slots_up_to_the_depth_and_only_on_handles_that_may_stage() {
    let c = fake();
    let mut s = connected(&c);
    let h = open(&mut s, &c, "rw", false, 1);
    let stage = |offset| Msg::Stage {
        handle: h,
        offset,
        len: 4096,
    };
    let slot = |st: Step<u32>| match st {
        Step::Stage { slot, region, .. } => {
            assert_eq!(region, 0);
            slot
        }
        other => panic!("expected a stage step, got {other:?}"),
    };
    // one-sided bytes are not staged, and a chunk is the most one request moves
    assert_eq!(code(s.step(stage(0), &c)), ErrorCode::NotBounce);
    assert!(message(s.step(
        Msg::Stage {
            handle: h,
            offset: 64 << 10,
            len: RULES.bounce_chunk + 1,
        },
        &c
    ))
    .contains("1 to"));
    let b = 64 << 10;
    let got: Vec<u32> = (0..RULES.pull_depth)
        .map(|i| slot(s.step(stage(b + u64::from(i) * 4096), &c)))
        .collect();
    assert_eq!(got, (0..RULES.pull_depth).collect::<Vec<_>>());
    // every slot held: busy until one is released
    let full = s.step(stage(b), &c);
    assert!(message(full).contains("not yet released"));
    assert!(matches!(
        s.step(Msg::Unstage { slot: 1 }, &c),
        Step::Unstage(1)
    ));
    // released twice, or never held: nothing happens
    assert!(matches!(s.step(Msg::Unstage { slot: 1 }, &c), Step::Ignore));
    assert!(matches!(
        s.step(Msg::Unstage { slot: 63 }, &c),
        Step::Ignore
    ));
    assert!(matches!(
        s.step(Msg::Unstage { slot: u32::MAX }, &c),
        Step::Ignore
    ));
    assert_eq!(slot(s.step(stage(b), &c)), 1);
    // a slot the driver could not fill is free again
    s.unstaged(1);
    assert_eq!(slot(s.step(stage(b), &c)), 1);

    // a handle the driver did not let stage is told to use bounce requests
    let mut s = connected(&c);
    let h = match s.step(
        Msg::Open {
            region: "ro".into(),
            write: false,
            first: None,
        },
        &c,
    ) {
        Step::Open {
            region, writable, ..
        } => s.opened(region, writable, 0, false, 2),
        other => panic!("open: {other:?}"),
    };
    let m = message(s.step(
        Msg::Stage {
            handle: h,
            offset: 0,
            len: 4096,
        },
        &c,
    ));
    assert!(m.contains("use bounce requests"), "{m}");
}

#[test]
fn a_staged_fetch_is_expected_once_a_qp_and_a_handle_read_past_its_direct_part_are_there() {
    let mut c = fake();
    // `ram`: all one-sided
    c.infos.push(crate::server::testkit::info(
        "ram",
        1 << 20,
        AccessMode::ReadWrite,
    ));
    c.direct.push(1 << 20);
    c.removed.push(false);
    let mut s = Session::new(RULES, Scope::All);
    let h = open(&mut s, &c, "rw", false, 1);
    assert!(!s.expects_staged_fetch(true, &c), "no QP yet");
    connect(&mut s, &c);
    assert!(s.expects_staged_fetch(true, &c));
    assert!(
        !s.expects_staged_fetch(false, &c),
        "the driver staged into a slot before"
    );
    // a slot held by the client: it asked already
    let Step::Stage { slot, .. } = s.step(
        Msg::Stage {
            handle: h,
            offset: 64 << 10,
            len: 4096,
        },
        &c,
    ) else {
        panic!("expected a stage step");
    };
    assert!(!s.expects_staged_fetch(true, &c));
    s.unstaged(slot);
    assert!(s.expects_staged_fetch(true, &c));

    // handles that will not stage a fetch: one opened for writing, one on a region all
    // one-sided, one the driver did not let stage
    for (name, write, pull) in [
        ("rw", true, true),
        ("ram", false, true),
        ("ro", false, false),
    ] {
        let mut s = connected(&c);
        match s.step(
            Msg::Open {
                region: name.into(),
                write,
                first: None,
            },
            &c,
        ) {
            Step::Open {
                region, writable, ..
            } => {
                s.opened(region, writable, c.direct[region], pull, 0);
            }
            other => panic!("open {name}: {other:?}"),
        }
        assert!(!s.expects_staged_fetch(true, &c), "{name} write={write}");
    }
}
