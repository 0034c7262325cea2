use super::*;
use crate::provider::HostMemory;
use verbs::SharedMemory;

/// A device whose memory is host RAM the test can see, with a window over it.
#[derive(Debug)]
struct FakeDevice {
    mem: Arc<SharedMemory>,
    window: bool,
}

impl FakeDevice {
    fn new(len: usize, window: bool) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            mem: Arc::new(SharedMemory::anonymous(len, false).unwrap()),
            window,
        })
    }
}

impl DeviceBacking for FakeDevice {
    fn describe(&self) -> String {
        "fake device".into()
    }
    fn len(&self) -> u64 {
        self.mem.len() as u64
    }
    fn copy_out(&self, offset: u64, out: &mut [u8]) -> Result<(), Error> {
        Ok(self.mem.read_at(offset, out)?)
    }
    fn copy_in(&self, offset: u64, data: &[u8]) -> Result<(), Error> {
        Ok(self.mem.write_at(offset, data)?)
    }
    fn map_window(&self, range: Range<u64>) -> Result<Arc<dyn Provider>, Error> {
        if !self.window {
            return Err(Error::Unavailable {
                what: "a P2P window".into(),
                reason: "this device has none".into(),
                fix: "-".into(),
            });
        }
        Ok(Arc::new(HostMemory::window(
            Arc::clone(&self.mem),
            range.start,
            range.end - range.start,
            true,
        )?))
    }
}

fn kinds(segs: &[Segment]) -> Vec<(&'static str, Range<u64>)> {
    segs.iter().map(|s| (s.kind(), s.range.clone())).collect()
}

#[test]
fn a_small_window_splits_a_range_into_window_and_bounce() {
    let dev = FakeDevice::new(4 * UNIT as usize, true);
    let r = DevicePrivate::new(dev, 2 * UNIT, Policy::Copy);
    // the plan keeps its leases: the first two units fill the window
    let segs = r.plan(100, 3 * UNIT).unwrap();
    assert_eq!(
        kinds(&segs),
        vec![
            ("window", 100..UNIT),
            ("window", UNIT..2 * UNIT),
            ("bounce", 2 * UNIT..3 * UNIT + 100)
        ]
    );
    assert_eq!(r.window_in_use(), 2 * UNIT);
    drop(segs);
    // unused mappings are evicted, least recently used first
    let segs = r.plan(3 * UNIT, 10).unwrap();
    assert_eq!(kinds(&segs), vec![("window", 3 * UNIT..3 * UNIT + 10)]);
    let s = r.stats();
    // units 2 and 3 fell back in the first plan
    assert_eq!((s.window_maps, s.window_fallbacks), (3, 2));
    let (device, mapped, host, freed) = r.residency();
    assert_eq!((device, host, freed), (4, 0, 0));
    assert!((1..=2).contains(&mapped), "{mapped} units mapped");
    assert!(r.window_in_use() <= 2 * UNIT);
}

#[test]
fn copies_that_may_not_map_leave_the_window_to_the_nic() {
    let dev = FakeDevice::new(4 * UNIT as usize, true);
    let data: Vec<u8> = (0..2 * UNIT).map(|i| (i % 241) as u8).collect();
    let r = DevicePrivate::new(
        Arc::clone(&dev) as Arc<dyn DeviceBacking>,
        2 * UNIT,
        Policy::Copy,
    );
    r.set_copies_map_window(false);
    r.write(UNIT / 2, &data).unwrap();
    let mut back = vec![0; data.len()];
    r.read(UNIT / 2, &mut back).unwrap();
    assert_eq!(back, data);
    let mut dev_bytes = vec![0; data.len()];
    dev.copy_out(UNIT / 2, &mut dev_bytes).unwrap();
    assert_eq!(dev_bytes, data, "the copy engine wrote the device itself");
    let s = r.stats();
    assert_eq!(
        (s.window_maps, s.window_bytes, s.window_fallbacks),
        (0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.bounce_bytes, 2 * data.len() as u64, "{s:?}");
    assert_eq!(r.window_in_use(), 0);
    // the NIC's plan still maps units into the window
    let segs = r.plan(0, UNIT).unwrap();
    assert_eq!(kinds(&segs), vec![("window", 0..UNIT)]);
    drop(segs);
    // and the migrate policy still migrates on a CPU copy
    let m = DevicePrivate::new(dev as Arc<dyn DeviceBacking>, 2 * UNIT, Policy::Migrate);
    m.set_copies_map_window(false);
    let mut b = [0u8; 8];
    m.read(UNIT, &mut b).unwrap();
    assert_eq!(m.residency_at(UNIT), Some(Residency::Host));
    assert_eq!((m.stats().migrations, m.stats().window_maps), (1, 0));
}

#[test]
fn without_a_window_the_migrate_policy_moves_units_to_host_ram() {
    let dev = FakeDevice::new(3 * UNIT as usize, false);
    dev.copy_in(UNIT, b"device bytes").unwrap();
    let r = DevicePrivate::new(
        Arc::clone(&dev) as Arc<dyn DeviceBacking>,
        0,
        Policy::Migrate,
    );
    let mut b = [0u8; 12];
    r.read(UNIT, &mut b).unwrap();
    assert_eq!(&b, b"device bytes");
    assert_eq!(r.residency_at(UNIT), Some(Residency::Host));
    assert_eq!(r.residency_at(0), Some(Residency::Device));
    // writes now go to host RAM, not the device
    r.write(UNIT, b"HOST").unwrap();
    let mut d = [0u8; 4];
    dev.copy_out(UNIT, &mut d).unwrap();
    assert_eq!(&d, b"devi");
    r.read(UNIT, &mut d).unwrap();
    assert_eq!(&d, b"HOST");
    assert_eq!(r.stats().migrations, 1);
}

#[test]
fn a_freed_unit_is_never_touched_and_planned_segments_fail() {
    let dev = FakeDevice::new(2 * UNIT as usize, true);
    let r = DevicePrivate::new(dev, UNIT, Policy::Copy);
    let segs = r.plan(0, 2 * UNIT).unwrap();
    assert_eq!(kinds(&segs)[0].0, "window");
    // the owner frees unit 1 while the transfer holds its plan; unit 0 is still leased,
    // so invalidating it times out (unlinked, released when the lease ends)
    assert_eq!(
        r.invalidate(UNIT..2 * UNIT, Invalidation::Free, Duration::ZERO)
            .unwrap(),
        0
    );
    let mut b = vec![0u8; UNIT as usize];
    let e = r.read_segment(&segs[1], &mut b).unwrap_err();
    assert!(matches!(e, Error::Invalidated(_)), "{e}");
    assert!(r.read_segment(&segs[0], &mut b).is_ok());
    assert!(matches!(r.plan(UNIT, 1), Err(Error::Invalidated(_))));
    let e = r
        .invalidate(0..1, Invalidation::Move, Duration::from_millis(10))
        .unwrap_err();
    assert_eq!(e.entries, 1);
    drop(segs);
    assert_eq!(r.window_in_use(), 0, "released with its last lease");
    r.reallocate(UNIT..2 * UNIT).unwrap();
    let mut z = [1u8; 4];
    r.read(UNIT, &mut z).unwrap();
    assert_eq!(z, [0; 4]);
}

#[test]
fn the_memfd_device_is_reached_by_its_copy_engine_and_says_why_it_has_no_window() {
    let dev = Arc::new(MemfdDevice::new(3 * UNIT - 5).unwrap());
    let r = DevicePrivate::new(
        Arc::clone(&dev) as Arc<dyn DeviceBacking>,
        UNIT,
        Policy::Copy,
    );
    let data: Vec<u8> = (0..2 * UNIT).map(|i| (i % 251) as u8).collect();
    r.write(UNIT / 2, &data).unwrap();
    let mut back = vec![0; data.len()];
    r.read(UNIT / 2, &mut back).unwrap();
    assert_eq!(back, data);
    let s = r.stats();
    if std::path::Path::new("/dev/udmabuf").exists() {
        assert!(s.window_maps > 0, "{s:?}");
    } else {
        // no udmabuf here: every unit fell back to the copy engine
        assert_eq!(s.window_bytes, 0);
        assert_eq!(s.bounce_bytes, 2 * data.len() as u64);
        assert!(dev
            .map_window(0..UNIT)
            .unwrap_err()
            .to_string()
            .contains("CONFIG_UDMABUF"));
    }
    assert!(
        r.describe().contains("3 units of 64 KiB"),
        "{}",
        r.describe()
    );
    assert!(MemfdDevice::new(0).is_err());
}

#[test]
fn bad_ranges_and_policies_are_refused() {
    let r = DevicePrivate::new(FakeDevice::new(UNIT as usize, true), UNIT, Policy::Copy);
    assert!(matches!(r.plan(UNIT, 1), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        r.plan(u64::MAX, 2),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!("copy".parse::<Policy>(), Ok(Policy::Copy));
    assert!("move"
        .parse::<Policy>()
        .unwrap_err()
        .contains("migrate or copy"));
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Read(u64, u64),
        Write(u64, u64, u8),
        Move(u64, u64),
        Free(u64),
        Realloc(u64),
    }

    const LEN: u64 = 6 * UNIT + 1000;

    fn op() -> impl Strategy<Value = Op> {
        let range = (0..LEN).prop_flat_map(|o| (Just(o), 1..=(LEN - o).min(3 * UNIT)));
        prop_oneof![
            4 => range.clone().prop_map(|(o, l)| Op::Read(o, l)),
            4 => (range.clone(), any::<u8>()).prop_map(|((o, l), v)| Op::Write(o, l, v)),
            1 => range.prop_map(|(o, l)| Op::Move(o, l)),
            1 => (0..LEN / UNIT + 1).prop_map(Op::Free),
            1 => (0..LEN / UNIT + 1).prop_map(Op::Realloc),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Random page states, offsets and lengths: every byte read equals a reference copy,
        /// freed units fail instead of returning stale data, and the bytes by path add up.
        #[test]
        fn data_is_identical_to_a_reference(
            ops in proptest::collection::vec(op(), 1..40),
            window_units in 0u64..4,
            migrate in any::<bool>(),
            has_window in any::<bool>(),
        ) {
            let dev = FakeDevice::new(LEN as usize, has_window);
            let policy = if migrate { Policy::Migrate } else { Policy::Copy };
            let r = DevicePrivate::new(dev, window_units * UNIT, policy);
            let mut reference = vec![0u8; LEN as usize];
            let mut freed = vec![false; LEN.div_ceil(UNIT) as usize];
            let mut moved_bytes = 0u64;
            let touches_freed = |freed: &[bool], o: u64, l: u64| {
                (o / UNIT..(o + l).div_ceil(UNIT)).any(|i| freed[i as usize])
            };
            for op in ops {
                match op {
                    Op::Read(o, l) => {
                        let mut b = vec![0u8; l as usize];
                        let res = r.read(o, &mut b);
                        if touches_freed(&freed, o, l) {
                            prop_assert!(matches!(res, Err(Error::Invalidated(_))));
                        } else {
                            prop_assert!(res.is_ok(), "{res:?}");
                            prop_assert_eq!(&b[..], &reference[o as usize..(o + l) as usize]);
                            moved_bytes += l;
                        }
                    }
                    Op::Write(o, l, v) => {
                        let data = vec![v; l as usize];
                        let res = r.write(o, &data);
                        if touches_freed(&freed, o, l) {
                            prop_assert!(matches!(res, Err(Error::Invalidated(_))));
                        } else {
                            prop_assert!(res.is_ok(), "{res:?}");
                            reference[o as usize..(o + l) as usize].copy_from_slice(&data);
                            moved_bytes += l;
                        }
                    }
                    Op::Move(o, l) => {
                        prop_assert!(r.invalidate(o..o + l, Invalidation::Move, Duration::from_secs(1)).is_ok());
                    }
                    Op::Free(i) => {
                        prop_assert!(r.invalidate(i * UNIT..(i + 1) * UNIT, Invalidation::Free, Duration::from_secs(1)).is_ok());
                        freed[i as usize] = true;
                    }
                    Op::Realloc(i) => {
                        if freed[i as usize] {
                            let ur = i * UNIT..((i + 1) * UNIT).min(LEN);
                            r.reallocate(ur.clone()).unwrap();
                            reference[ur.start as usize..ur.end as usize].fill(0);
                            freed[i as usize] = false;
                        }
                    }
                }
                prop_assert!(r.window_in_use() <= window_units * UNIT);
            }
            let s = r.stats();
            prop_assert_eq!(s.window_bytes + s.host_bytes + s.bounce_bytes, moved_bytes);
            if !has_window || window_units == 0 {
                prop_assert_eq!(s.window_bytes, 0);
            }
            if migrate {
                prop_assert_eq!(s.bounce_bytes, 0);
            } else {
                prop_assert_eq!(s.migrations, 0);
            }
        }
    }
}
