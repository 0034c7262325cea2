//! Any sequence of requests keeps the session's rules: a property test over generated
//! messages, and the fuzzers' script reader reaching every request, both checked against the
//! testkit's model.

use proptest::prelude::*;

use super::bounce;
use crate::protocol::Msg;
use crate::server::testkit::{Model, ENDPOINT};

fn any_msg() -> impl Strategy<Value = Msg> {
    let handle = prop_oneof![0u32..4, Just(0x10000u32), Just(0x20001), any::<u32>()];
    let offset = prop_oneof![
        Just(0u64),
        Just(64 << 10),
        Just((1 << 20) - 1),
        any::<u64>()
    ];
    let len = prop_oneof![Just(0u64), Just(1), Just(1 << 16), any::<u64>()];
    let name = prop_oneof![
        Just("rw"),
        Just("ro"),
        Just("gone"),
        Just("held"),
        Just("x")
    ];
    prop_oneof![
        (
            name,
            any::<bool>(),
            proptest::option::of((offset.clone(), len.clone()))
        )
            .prop_map(|(n, write, first)| Msg::Open {
                region: n.into(),
                write,
                first: first.map(|(offset, len)| crate::protocol::Span { offset, len }),
            }),
        handle.clone().prop_map(|handle| Msg::Close { handle }),
        (handle.clone(), offset.clone(), len.clone(), any::<bool>())
            .prop_map(|(handle, offset, len, to_region)| bounce(handle, offset, len, to_region)),
        (handle.clone(), offset.clone(), len.clone()).prop_map(|(handle, offset, len)| {
            Msg::Checksum {
                handle,
                offset,
                len,
            }
        }),
        (handle, offset, len, any::<bool>()).prop_map(|(handle, offset, len, to_region)| {
            Msg::Transferred {
                handle,
                offset,
                len,
                to_region,
                micros: 1,
            }
        }),
        Just(Msg::List),
    ]
}

proptest! {
    /// Whatever a client sends, the session never exceeds its limits, never lets a request
    /// reach outside a region or a put reach a read-only handle, and its handle table
    /// matches a model (the same checks the fuzzers run).
    #[test]
    fn any_sequence_keeps_the_rules(
        msgs in prop::collection::vec(any_msg(), 1..64),
        drain_at in 0usize..80,
    ) {
        let mut m = Model::new();
        m.apply(Msg::Connect {
            endpoint: ENDPOINT,
            nic: None,
        });
        for (i, msg) in msgs.into_iter().enumerate() {
            if i == drain_at {
                m.drain();
            }
            m.apply(msg);
        }
    }
}

#[test]
fn the_fuzzers_script_reader_reaches_every_request_and_live_handles() {
    let mut x = 0x9e37_79b9u32;
    let bytes: Vec<u8> = (0..20_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    let mut kinds = std::collections::HashMap::new();
    let mut m = Model::new();
    let mut script = crate::server::testkit::Script::new(&bytes);
    let mut steps = std::collections::HashSet::new();
    while let Some(msg) = script.next_msg() {
        *kinds.entry(msg.kind()).or_insert(0) += 1;
        if matches!(msg, Msg::Bye) {
            continue;
        }
        let before = m.live();
        m.apply(msg);
        let after = m.live();
        steps.insert(match after.len().cmp(&before.len()) {
            std::cmp::Ordering::Greater => "opened",
            std::cmp::Ordering::Less => "closed",
            std::cmp::Ordering::Equal => "same",
        });
        script.live = after;
    }
    for k in [
        "open",
        "close",
        "bounce",
        "checksum",
        "transferred",
        "flush",
        "connect",
        "list",
        "bye",
    ] {
        assert!(kinds.contains_key(k), "{k} never produced: {kinds:?}");
    }
    assert!(
        steps.contains("opened") && steps.contains("closed"),
        "handles are opened and closed: {steps:?}"
    );
}
