//! An open that names its fetch's first range: what the session lets the driver stage with it.

use super::{connect, connected, fake, open};
use crate::protocol::{DataPath, ErrorCode, Extent, Msg, Span};
use crate::server::session::first::FirstStage;
use crate::server::session::{Session, Step};
use crate::server::testkit::{Fake, RULES};
use crate::token::Scope;

/// `rw`'s extents as its `Opened` shows them: 64 KiB one-sided, then bounce, cut in two.
fn extents() -> Vec<Extent> {
    vec![
        Extent {
            offset: 0,
            len: 64 << 10,
            path: DataPath::Direct,
        },
        Extent {
            offset: 64 << 10,
            len: 100 << 10,
            path: DataPath::Bounce,
        },
        Extent {
            offset: 164 << 10,
            len: (1 << 20) - (164 << 10),
            path: DataPath::Bounce,
        },
    ]
}

fn span(offset: u64, len: u64) -> Span {
    Span { offset, len }
}

/// The fake catalog and a session with a QP and `rw` open for reading (its handle).
fn reading() -> (Fake, Session<u32>, u32) {
    let c = fake();
    let mut s = connected(&c);
    let h = open(&mut s, &c, "rw", false, 1);
    (c, s, h)
}

#[test]
fn the_first_piece_is_cut_as_the_client_cuts_its_fetch_and_holds_a_slot() {
    let (c, mut s, h) = reading();
    let e = extents();
    // at most the client's span and the bounce chunk (64 KiB in these rules)
    let f = s.stage_first(h, span(64 << 10, 1 << 20), &e, 0, &c);
    assert_eq!(
        f,
        Some(Ok(FirstStage {
            region: 0,
            offset: 64 << 10,
            len: RULES.bounce_chunk,
            slot: 0,
        }))
    );
    assert_eq!(
        s.staged_count(),
        1,
        "the slot is the client's until released"
    );
    // never across an extent, and no longer than asked
    let f = s
        .stage_first(h, span(160 << 10, 1 << 20), &e, 0, &c)
        .unwrap()
        .unwrap();
    assert_eq!((f.offset, f.len, f.slot), (160 << 10, 4 << 10, 1));
    let f = s
        .stage_first(h, span(200 << 10, 100), &e, 0, &c)
        .unwrap()
        .unwrap();
    assert_eq!((f.len, f.slot), (100, 2));
    // all slots held: refused as a Stage would be, and nothing else held
    let (code, message) = s
        .stage_first(h, span(300 << 10, 4096), &e, 0, &c)
        .unwrap()
        .unwrap_err();
    assert_eq!(code, ErrorCode::Busy, "{message}");
    assert_eq!(s.staged_count(), RULES.pull_depth);
    // the client reads and releases it as any staged chunk
    assert!(matches!(
        s.step(Msg::Unstage { slot: 0 }, &c),
        Step::Unstage(0)
    ));
    assert_eq!(s.staged_count(), RULES.pull_depth - 1);
}

#[test]
fn a_first_range_that_starts_partway_into_the_piece_alignment_stages_up_to_its_next_multiple() {
    // as the client cuts it when its `Opened` gave a `piece_align`
    let (c, mut s, h) = reading();
    let e = extents();
    let f = s
        .stage_first(h, span((64 << 10) + 777, 1 << 20), &e, 512, &c)
        .unwrap()
        .unwrap();
    assert_eq!((f.offset, f.len), ((64 << 10) + 777, 512 - 777 % 512));
    // one that starts on a multiple: up to the bounce chunk's next multiple, as without
    let f = s
        .stage_first(h, span(64 << 10, 1 << 20), &e, 512, &c)
        .unwrap()
        .unwrap();
    assert_eq!((f.offset, f.len), (64 << 10, RULES.bounce_chunk));
    let f = s
        .stage_first(h, span((128 << 10) + 4, 100), &e, 4096, &c)
        .unwrap()
        .unwrap();
    assert_eq!(f.len, 100);
}

#[test]
fn nothing_is_staged_for_a_direct_piece_an_empty_range_or_one_past_the_end() {
    let (c, mut s, h) = reading();
    let e = extents();
    for (offset, len) in [
        (0, 1 << 20),
        (4096, 10),
        (64 << 10, 0),
        (1 << 20, 4096),
        (u64::MAX, 1),
    ] {
        assert_eq!(
            s.stage_first(h, span(offset, len), &e, 0, &c),
            None,
            "{offset}+{len}"
        );
    }
    // a handle that is not open, or closed
    assert_eq!(s.stage_first(h + 1, span(64 << 10, 10), &e, 0, &c), None);
    assert_eq!(s.staged_count(), 0);
}

#[test]
fn only_a_handle_opened_for_reading_that_stages_gets_a_first_chunk() {
    let c = fake();
    let e = extents();
    // an open for writing drops the range
    let mut s = connected(&c);
    match s.step(
        Msg::Open {
            region: "rw".into(),
            write: true,
            first: Some(span(64 << 10, 4096)),
        },
        &c,
    ) {
        Step::Open { first, .. } => assert_eq!(first, None),
        other => panic!("{other:?}"),
    }
    // the driver did not let the handle stage (a device without windows)
    let mut s = connected(&c);
    let Step::Open {
        region,
        writable,
        first,
    } = s.step(
        Msg::Open {
            region: "rw".into(),
            write: false,
            first: Some(span(64 << 10, 4096)),
        },
        &c,
    )
    else {
        panic!("expected an open step");
    };
    assert_eq!(first, Some(span(64 << 10, 4096)));
    let h = s.opened(region, writable, c.direct[region], false, 1);
    assert_eq!(s.stage_first(h, span(64 << 10, 4096), &e, 0, &c), None);
    // no QP yet: refused (the open goes on without), no slot held
    let mut s = Session::new(RULES, Scope::All);
    let h = open(&mut s, &c, "rw", false, 1);
    let (code, _) = s
        .stage_first(h, span(64 << 10, 4096), &e, 0, &c)
        .unwrap()
        .unwrap_err();
    assert_eq!(code, ErrorCode::BadRequest);
    assert_eq!(s.staged_count(), 0);
    connect(&mut s, &c);
    assert!(matches!(
        s.stage_first(h, span(64 << 10, 4096), &e, 0, &c),
        Some(Ok(_))
    ));
    // a region removed since the open: refused
    let mut c2 = fake();
    let mut s = connected(&c2);
    let h = open(&mut s, &c2, "rw", false, 1);
    c2.removed[0] = true;
    let (code, message) = s
        .stage_first(h, span(64 << 10, 4096), &e, 0, &c2)
        .unwrap()
        .unwrap_err();
    assert_eq!(code, ErrorCode::Removed, "{message}");
}
