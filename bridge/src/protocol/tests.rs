use super::*;
use proptest::prelude::*;

fn sample() -> Vec<Msg> {
    let info = RegionInfo {
        name: "ram".into(),
        size: 64 << 20,
        access: AccessMode::ReadWrite,
        kind: "host".into(),
        path: DataPath::Mixed,
        reason: "direct: pinned".into(),
        strategy: Some("pinned".into()),
        extents: vec![
            Extent {
                offset: 0,
                len: 1 << 20,
                path: DataPath::Direct,
            },
            Extent {
                offset: 1 << 20,
                len: 63 << 20,
                path: DataPath::Bounce,
            },
        ],
        residency: Some("3 of 16 pages device-private, 13 in host RAM".into()),
        server_puts: true,
        nic: Some("rxe1".into()),
    };
    vec![
        Msg::Hello {
            version: VERSION,
            token: "s3cret".into(),
            client: "c".into(),
        },
        Msg::Welcome {
            version: VERSION,
            server: "s".into(),
            max_outstanding: 16,
            nics: vec![
                ServerNic {
                    name: "rxe0".into(),
                    addr: Some(std::net::Ipv4Addr::new(10, 77, 0, 1)),
                },
                ServerNic {
                    name: "rxe1".into(),
                    addr: None,
                },
            ],
        },
        Msg::Locate {
            region: "ram".into(),
        },
        Msg::Located {
            nic: Some("rxe1".into()),
        },
        Msg::List,
        Msg::Regions {
            regions: vec![info.clone()],
        },
        Msg::Flush {
            handle: 3,
            offset: 4096,
            len: 1 << 20,
        },
        Msg::Flushed { len: 1 << 20 },
        Msg::Stage {
            handle: 3,
            offset: 1 << 20,
            len: 1 << 20,
        },
        Msg::Staged {
            slot: 7,
            addr: 1 << 44,
            rkey: 0x1234,
            len: 1 << 20,
            lent: false,
            hold_ms: 0,
        },
        Msg::Staged {
            slot: 8,
            addr: 1 << 44,
            rkey: 0x1235,
            len: 1 << 20,
            lent: true,
            hold_ms: 30_000,
        },
        Msg::Unstage { slot: 7 },
        Msg::KeepAlive,
        Msg::Open {
            region: "ram".into(),
            write: true,
            first: None,
        },
        Msg::Opened {
            handle: 1,
            info: info.clone(),
            addr: u64::MAX,
            rkey: 7,
            len: 64 << 20,
            bounce_chunk: 1 << 20,
            piece_align: 512,
            segments: Vec::new(),
            pull_depth: 8,
            first: None,
        },
        Msg::Open {
            region: "ram".into(),
            write: false,
            first: Some(Span {
                offset: 3 << 20,
                len: 1 << 20,
            }),
        },
        Msg::Opened {
            handle: 3,
            info: info.clone(),
            addr: 0,
            rkey: 0,
            len: 0,
            bounce_chunk: 1 << 20,
            piece_align: 0,
            segments: Vec::new(),
            pull_depth: 8,
            first: Some(Box::new(StagedChunk {
                offset: 3 << 20,
                len: 1 << 20,
                slot: 0,
                addr: 1 << 44,
                rkey: 0x55,
                lent: true,
                hold_ms: 30_000,
            })),
        },
        Msg::Opened {
            handle: 2,
            info: RegionInfo {
                name: "big".into(),
                size: 3 << 30,
                access: AccessMode::ReadWrite,
                kind: "host".into(),
                path: DataPath::Direct,
                reason: String::new(),
                strategy: Some("pinned".into()),
                extents: Vec::new(),
                residency: None,
                server_puts: false,
                nic: None,
            },
            addr: 1 << 40,
            rkey: 9,
            len: 1 << 30,
            bounce_chunk: 1 << 20,
            piece_align: 0,
            segments: vec![
                Segment {
                    offset: 0,
                    len: 1 << 30,
                    addr: 1 << 40,
                    rkey: 9,
                },
                Segment {
                    offset: 1 << 30,
                    len: 2 << 30,
                    addr: (1 << 40) + (1 << 30),
                    rkey: 10,
                },
            ],
            pull_depth: 0,
            first: None,
        },
        Msg::error(ErrorCode::OutOfRange, "offset 5 + length 9 > 10"),
        Msg::Bye,
    ]
}

#[test]
fn extents_default_to_the_region_path() {
    let mut r = RegionInfo {
        name: "r".into(),
        size: 10,
        access: AccessMode::ReadOnly,
        kind: "host".into(),
        path: DataPath::Bounce,
        reason: String::new(),
        strategy: None,
        extents: Vec::new(),
        residency: None,
        server_puts: false,
        nic: None,
    };
    assert_eq!(
        r.extents(),
        vec![Extent {
            offset: 0,
            len: 10,
            path: DataPath::Bounce
        }]
    );
    // an older server's record (no reason/strategy/extents) still decodes
    let old = r#"{"name":"r","size":10,"access":"read-only","kind":"host","path":"direct"}"#;
    r = serde_json::from_str(old).unwrap();
    assert_eq!(r.extents()[0].path, DataPath::Direct);
}

#[test]
fn a_staged_reply_says_lent_only_when_the_chunk_is_lent() {
    let copied = Msg::Staged {
        slot: 1,
        addr: 4096,
        rkey: 9,
        len: 512,
        lent: false,
        hold_ms: 0,
    };
    let json = serde_json::to_string(&copied).unwrap();
    assert!(!json.contains("lent") && !json.contains("hold"), "{json}");
    // an older server's reply (no `lent`) is a copied chunk
    let old: Msg =
        serde_json::from_str(r#"{"type":"staged","slot":1,"addr":4096,"rkey":9,"len":512}"#)
            .unwrap();
    assert_eq!(old, copied);
    let lent: Msg = serde_json::from_str(
        r#"{"type":"staged","slot":1,"addr":4096,"rkey":9,"len":512,"lent":true}"#,
    )
    .unwrap();
    assert!(matches!(
        lent,
        Msg::Staged {
            lent: true,
            hold_ms: 0,
            ..
        }
    ));
    let held: Msg = serde_json::from_str(
        r#"{"type":"staged","slot":1,"addr":4096,"rkey":9,"len":512,"lent":true,"hold_ms":3000}"#,
    )
    .unwrap();
    assert!(matches!(
        held,
        Msg::Staged {
            lent: true,
            hold_ms: 3000,
            ..
        }
    ));
}

#[test]
fn frames_roundtrip_even_when_split_byte_by_byte() {
    let msgs = sample();
    let bytes: Vec<u8> = msgs.iter().flat_map(encode).collect();
    let mut d = Decoder::new();
    let mut out = Vec::new();
    for b in bytes {
        d.feed(&[b]);
        while let Some(m) = d.next_msg().unwrap() {
            out.push(m);
        }
    }
    assert_eq!(out, msgs);
    d.finish().unwrap();
}

#[test]
fn holds_frame_says_whether_the_next_message_or_its_error_is_buffered() {
    let mut d = Decoder::new();
    assert!(!d.holds_frame());
    let m = encode(&Msg::KeepAlive);
    d.feed(&m[..3]);
    assert!(!d.holds_frame(), "not even the length");
    d.feed(&m[3..m.len() - 1]);
    assert!(!d.holds_frame(), "one byte short");
    d.feed(&m[m.len() - 1..]);
    assert!(d.holds_frame());
    assert_eq!(d.next_msg().unwrap(), Some(Msg::KeepAlive));
    assert!(!d.holds_frame());
    // a frame over the limit: its error is ready without its bytes
    d.set_max_frame(16);
    d.feed(&(1000u32).to_be_bytes());
    assert!(d.holds_frame());
    assert!(matches!(d.next_msg(), Err(DecodeError::TooLarge { .. })));
}

#[test]
fn before_authentication_only_small_frames_are_buffered() {
    let mut d = Decoder::new();
    d.set_max_frame(MAX_HELLO_FRAME);
    // a real hello fits
    d.feed(&encode(&Msg::Hello {
        version: VERSION,
        token: "t".repeat(256).into(),
        client: "c".into(),
    }));
    assert!(matches!(d.next_msg(), Ok(Some(Msg::Hello { .. }))));
    // a prefix announcing 1 MiB is refused before any of it is buffered
    d.feed(&((MAX_FRAME as u32).to_be_bytes()));
    assert_eq!(
        d.next_msg(),
        Err(DecodeError::TooLarge {
            len: MAX_FRAME,
            limit: MAX_HELLO_FRAME
        })
    );
    // after the hello the full limit applies
    let mut d = Decoder::new();
    d.feed(&((MAX_HELLO_FRAME as u32 + 1).to_be_bytes()));
    assert_eq!(d.next_msg(), Ok(None));
}

#[test]
fn oversize_garbage_and_truncation_are_errors() {
    let mut d = Decoder::new();
    d.feed(b"GET / HTTP/1.1\r\n");
    assert!(matches!(d.next_msg(), Err(DecodeError::TooLarge { .. })));
    let mut d = Decoder::new();
    d.feed(&[0, 0, 0, 3, b'{', b'}', b'x']);
    assert!(matches!(d.next_msg(), Err(DecodeError::Malformed(_))));
    let mut d = Decoder::new();
    d.feed(&encode(&Msg::List)[..5]);
    assert_eq!(d.next_msg(), Ok(None));
    assert!(matches!(d.finish(), Err(DecodeError::Truncated(5))));
    let mut d = Decoder::new();
    let body = br#"{"type":"nope"}"#;
    d.feed(&(body.len() as u32).to_be_bytes());
    d.feed(body);
    let e = d.next_msg().unwrap_err();
    assert!(e.to_string().contains("nope"), "{e}");
}

#[test]
fn error_codes_are_kebab_case_on_the_wire() {
    assert_eq!(ErrorCode::UnknownRegion.to_string(), "unknown-region");
    let b = encode(&Msg::error(ErrorCode::ReadOnly, "x"));
    assert!(String::from_utf8_lossy(&b[4..]).contains(r#""code":"read-only""#));
}

#[test]
fn secrets_compare() {
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"abcd"));
    assert!(!constant_time_eq(b"", b"a"));
    assert!(constant_time_eq(b"", b""));
}

fn arb_msg() -> impl Strategy<Value = Msg> {
    let s = ".{0,40}";
    prop_oneof![
        (any::<u16>(), s, s).prop_map(|(version, token, client)| Msg::Hello {
            version,
            token: token.into(),
            client
        }),
        (any::<u16>(), s, any::<u32>(), s).prop_map(|(version, server, max_outstanding, nic)| {
            Msg::Welcome {
                version,
                server,
                max_outstanding,
                nics: if nic.is_empty() {
                    Vec::new()
                } else {
                    vec![ServerNic {
                        name: nic,
                        addr: Some(std::net::Ipv4Addr::from(max_outstanding)),
                    }]
                },
            }
        }),
        s.prop_map(|region| Msg::Locate { region }),
        proptest::option::of(s).prop_map(|nic| Msg::Located { nic }),
        Just(Msg::List),
        (
            s,
            any::<bool>(),
            proptest::option::of((any::<u64>(), any::<u64>()))
        )
            .prop_map(|(region, write, first)| Msg::Open {
                region,
                write,
                first: first.map(|(offset, len)| Span { offset, len }),
            }),
        (
            any::<u32>(),
            s,
            any::<u64>(),
            any::<bool>(),
            any::<u64>(),
            any::<u32>()
        )
            .prop_map(|(handle, name, size, ro, addr, rkey)| Msg::Opened {
                handle,
                info: RegionInfo {
                    name,
                    size,
                    access: if ro {
                        AccessMode::ReadOnly
                    } else {
                        AccessMode::ReadWrite
                    },
                    kind: "file".into(),
                    path: DataPath::Direct,
                    reason: String::new(),
                    strategy: None,
                    extents: Vec::new(),
                    residency: None,
                    server_puts: false,
                    nic: (!ro).then(|| "mlx5_1".into()),
                },
                addr,
                rkey,
                len: size,
                bounce_chunk: size / 2,
                piece_align: if ro { 4096 } else { 0 },
                segments: if ro {
                    Vec::new()
                } else {
                    vec![Segment {
                        offset: size / 3,
                        len: size / 5,
                        addr: addr / 2,
                        rkey: rkey ^ 1,
                    }]
                },
                pull_depth: (rkey % 17),
                first: (rkey % 3 == 0).then(|| {
                    Box::new(StagedChunk {
                        offset: size / 7,
                        len: size / 11,
                        slot: rkey % 64,
                        addr: addr ^ 5,
                        rkey: rkey.rotate_left(3),
                        lent: rkey % 2 == 0,
                        hold_ms: u64::from(rkey % 5) * 1000,
                    })
                }),
            }),
        (
            any::<u16>(),
            any::<[u8; 16]>(),
            any::<u32>(),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(|(lid, gid, qpn, psn, mtu)| Msg::Connect {
                endpoint: WireEndpoint {
                    lid,
                    gid,
                    qpn,
                    psn,
                    mtu
                },
                nic: (qpn % 2 == 0).then(|| format!("rxe{}", qpn % 7)),
            }),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(handle, offset, len)| {
            Msg::Checksum {
                handle,
                offset,
                len,
            }
        }),
        any::<u32>().prop_map(|crc32c| Msg::ChecksumIs { crc32c }),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            any::<u64>(),
            any::<u32>()
        )
            .prop_map(|(handle, offset, len, to_region, addr, rkey)| Msg::Bounce {
                handle,
                offset,
                len,
                to_region,
                addr,
                rkey
            }),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(handle, offset, len)| Msg::Stage {
            handle,
            offset,
            len
        }),
        (
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<bool>()
        )
            .prop_map(|(slot, addr, rkey, len, lent)| Msg::Staged {
                slot,
                addr,
                rkey,
                len,
                lent,
                hold_ms: if lent { addr % 60_000 } else { 0 },
            }),
        any::<u32>().prop_map(|slot| Msg::Unstage { slot }),
        any::<u32>().prop_map(|handle| Msg::Close { handle }),
        s.prop_map(|m| Msg::error(ErrorCode::Internal, m)),
        Just(Msg::Bye),
    ]
}

proptest! {
    #[test]
    fn decode_of_encode_is_identity(m in arb_msg()) {
        let mut d = Decoder::new();
        d.feed(&encode(&m));
        prop_assert_eq!(d.next_msg().unwrap(), Some(m));
        prop_assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut d = Decoder::new();
        d.feed(&bytes);
        for _ in 0..8 {
            match d.next_msg() {
                Ok(Some(_)) => continue,
                _ => break,
            }
        }
        let _ = d.finish();
    }

    #[test]
    fn arbitrary_json_payloads_never_panic(body in ".{0,200}") {
        let mut d = Decoder::new();
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body.as_bytes());
        d.feed(&f);
        let _ = d.next_msg();
    }
}
