//! The inspecting commands: `devices`, `topo`, `doctor`.

use anyhow::Context as _;
use bridge::size::human;

use super::emit;

/// The topology doctor's verdict for the pair (RDMA device, the memory's PCI device), when the
/// memory lives on a PCI device; and, with several RDMA devices, the one the topology ranks
/// best for it when that is another (and not as good as `rdma`).
fn topology_plans(
    provider: &dyn peermem::Provider,
    rdma: &str,
) -> Option<(peermem::topology::Pair, Option<peermem::topology::BestNic>)> {
    use peermem::topology::{Extra, Sysfs, Topology};
    let bdf = provider.pci_device()?;
    let extra = Extra {
        probes: driver_probes()
            .into_iter()
            .filter(|(n, _)| n == rdma)
            .collect(),
        kernel_config_p2pdma: Extra::read_kernel_config(),
    };
    let topo = Topology::read(&Sysfs::new("/sys"), &extra);
    let r = topo.rdma.iter().find(|r| r.name == rdma)?;
    let pair = topo.pair(r, topo.device(&bdf)?);
    // the report ranks the NICs only when there is more than one
    let better = topo
        .report()
        .best_nics
        .into_iter()
        .find(|b| b.device_pci == bdf)
        .filter(|b| b.rdma_device != rdma && !b.ties.iter().any(|t| t == rdma));
    Some((pair, better))
}

/// Driver probes for every RDMA device the live system has (ODP caps, dma-buf MR probe).
fn driver_probes() -> std::collections::BTreeMap<String, peermem::topology::DriverProbe> {
    use peermem::topology::{DriverProbe, Support};
    let mut out = std::collections::BTreeMap::new();
    let Ok(names) = verbs::device_names() else {
        return out;
    };
    for name in names {
        let probe = match verbs::Context::open(Some(&name)) {
            Ok(ctx) => {
                let odp = ctx.info().caps.odp;
                let (dmabuf_mr, why) = match verbs::ProtectionDomain::new(&ctx) {
                    Ok(pd) => match pd.probe_dmabuf_mr() {
                        verbs::DmabufSupport::Supported => (
                            Support::Supported,
                            "ibv_reg_dmabuf_mr(fd=-1): EBADF".to_string(),
                        ),
                        verbs::DmabufSupport::Unsupported => (
                            Support::Unsupported,
                            "ibv_reg_dmabuf_mr(fd=-1): EOPNOTSUPP".to_string(),
                        ),
                        verbs::DmabufSupport::Unknown(d) => (Support::Unknown, d),
                    },
                    Err(e) => (Support::Unknown, format!("no protection domain: {e}")),
                };
                DriverProbe {
                    odp: if odp.rc_rdma() {
                        Support::Supported
                    } else {
                        Support::Unsupported
                    },
                    dmabuf_mr,
                    detail: format!(
                        "odp general_caps {:#x} rc_odp_caps {:#x}; {why}",
                        odp.general_caps, odp.rc_odp_caps
                    ),
                }
            }
            Err(e) => DriverProbe {
                odp: Support::Unknown,
                dmabuf_mr: Support::Unknown,
                detail: format!("cannot open {name}: {e}"),
            },
        };
        out.insert(name, probe);
    }
    out
}

pub(crate) fn topo(
    root: &std::path::Path,
    json: bool,
    capture: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use peermem::topology::{Extra, Sysfs, Topology, CAPTURE_FILE};
    if !root.is_dir() {
        anyhow::bail!(
            "--sysfs-root {}: not a directory (give /sys, a fixture, or a directory made by --capture)",
            root.display()
        );
    }
    let fs = if capture.is_some() {
        Sysfs::recording(root)
    } else {
        Sysfs::new(root)
    };
    let extra = if fs.is_live() {
        Extra {
            probes: driver_probes(),
            kernel_config_p2pdma: Extra::read_kernel_config(),
        }
    } else {
        Extra::load(root).map_err(|e| anyhow::anyhow!("{e}"))?
    };
    let topo = Topology::read(&fs, &extra);
    let report = topo.report();
    if let Some(dir) = capture {
        if dir.exists()
            && std::fs::read_dir(dir)
                .with_context(|| format!("--capture {}", dir.display()))?
                .next()
                .is_some()
        {
            anyhow::bail!(
                "--capture {}: the directory is not empty (give a new directory)",
                dir.display()
            );
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let n = fs
            .capture_into(dir)
            .with_context(|| format!("copying sysfs into {}", dir.display()))?;
        std::fs::write(dir.join(CAPTURE_FILE), serde_json::to_vec_pretty(&extra)?)
            .with_context(|| format!("writing {}", dir.join(CAPTURE_FILE).display()))?;
        emit(&format!(
            "captured {n} sysfs entries ({} PCI functions, {} RDMA devices) and the driver probes into {}\nreplay: p2p-rdma topo --sysfs-root {}\n",
            topo.devices().count(),
            topo.rdma.len(),
            dir.display(),
            dir.display()
        ))?;
        return Ok(());
    }
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        emit(&report.render())?;
    }
    Ok(())
}

pub(crate) async fn doctor(
    spec: &str,
    reg: peermem::plan::RegChoice,
    device: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    use peermem::plan::{P2pPolicy, PathKind};
    let parsed: bridge::RegionSpec = format!("doctor={spec}").parse().map_err(|e: String| {
        anyhow::anyhow!("--region {spec}: {}", e.replace("region 'doctor': ", ""))
    })?;
    // a ring's slots as `serve` cuts them with its default bounce chunk
    let chunk = bridge::ServerConfig::DEFAULT_BOUNCE_CHUNK as u64;
    let (provider, _) = parsed.open(std::path::Path::new("/sys"), chunk)?;
    let ctx = verbs::Context::open(device)?;
    let pd = verbs::ProtectionDomain::new(&ctx)?;
    let len = provider.len();
    // the spec's own ,reg= ,p2p= ,window= apply as in serve (over --reg)
    let choice = parsed.options.choice(len, reg, P2pPolicy::Preferred);
    let (plan, better_nic) = match topology_plans(provider.as_ref(), ctx.name()) {
        Some((p, b)) => (Some(p), b),
        None => (None, None),
    };
    let block = (*provider)
        .as_any()
        .downcast_ref::<peermem::block::BlockStorage>();
    if let Some((b, ring)) = block.and_then(|b| b.ring().map(|r| (b, r))) {
        // as `serve` would with its default sharing (memory windows)
        let leg = bridge::path::ring_nic_leg(&pd, &ring, reg, true, b.ring_put_leg(), None).await;
        leg.record_on(b);
    }
    let legs = block.map(|b| b.legs_plan());
    // block storage moves no pages: its residency is the bytes each leg moved
    let residency_before = provider.residency().filter(|_| block.is_none());
    let (mut planned, segments) = bridge::path::decide_segments(&pd, &provider, choice)
        .await
        .map_err(|r| anyhow::anyhow!("{r}"))?;
    let segments = bridge::path::prove_segments(&pd, &provider, &mut planned, segments).await;
    let direct_len = segments.direct_len;
    let residency_after = provider.residency().filter(|_| block.is_none());
    let window_proof = match peermem::hmm::DevicePrivate::of(&*provider) {
        Some(dp) if dp.window_size() > 0 => {
            Some(peermem::plan::prove_window(&pd, dp, choice.reg, choice.p2p).await)
        }
        _ => None,
    };
    let d = &planned.decision;
    let direct = d.path == PathKind::Direct;
    // as `serve` would: memory the NIC reads only from page starts lends such chunks
    let page_starts = if direct {
        None
    } else {
        bridge::path::page_start_lending(&pd, &provider, d, None, provider.writable())
            .await
            .map(|(_, note)| note)
    };
    if json {
        emit(&format!(
            "{}\n",
            serde_json::json!({
                "device": ctx.name(),
                "plan": plan,
                "better_nic": better_nic,
                "memory": provider.kind(),
                "describe": provider.describe(),
                "size": len,
                "attempts": d.attempts,
                "chosen": d.mode,
                "path": d.path,
                "reason": d.reason,
                "direct_bytes": if direct { direct_len } else { 0 },
                "direct_mrs": if direct { segments.count() } else { 0 },
                "copy_engine": provider.copy_engine(),
                "residency_before": residency_before,
                "residency_after": residency_after,
                "window": window_proof,
                "legs": legs,
                "page_starts": page_starts,
            })
        ))?;
    } else {
        let mut o = format!("{} on {}:\n", provider.describe(), ctx.name());
        match &plan {
            Some(p) => {
                o.push_str(&format!(
                    "  plan (PCIe topology): {} -> {}: {} {}\n",
                    p.nic_pci.as_deref().unwrap_or("no PCI device"),
                    p.device_pci,
                    p.path.map(|c| c.as_str()).unwrap_or("-"),
                    p.verdict.as_str()
                ));
                for r in p
                    .reasons
                    .iter()
                    .filter(|r| r.severity != peermem::topology::Severity::Info)
                {
                    o.push_str(&format!("    [{}] {}\n", r.code, r.message));
                }
            }
            None => o.push_str("  plan: host memory, no PCIe peer path involved\n"),
        }
        if let Some(b) = &better_nic {
            o.push_str(&format!(
                "  ! {} is closer to this memory ({} {}): run with --device {}\n",
                b.rdma_device,
                b.path.map(|c| c.as_str()).unwrap_or("-"),
                b.verdict.as_str(),
                b.rdma_device
            ));
        }
        if let Some(r) = &residency_before {
            o.push_str(&format!("  residency before the attempts: {r}\n"));
        }
        for a in &d.attempts {
            o.push_str(&format!("  {a}\n"));
        }
        if let Some(r) = &residency_after {
            o.push_str(&format!("  residency after the attempts: {r}\n"));
        }
        if let Some(l) = &legs {
            o.push_str(&format!("  legs: {l}\n"));
        }
        if let Some(p) = &page_starts {
            o.push_str(&format!("  page starts: {p}\n"));
        }
        if let Some(w) = &window_proof {
            o.push_str("  P2P window, on the mapping of one unit:\n");
            for a in &w.attempts {
                o.push_str(&format!("    {a}\n"));
            }
            o.push_str(&format!("  window units: {}\n", w.reason));
        }
        o.push_str(&match d.mode {
            Some(m) if direct && direct_len < len => format!(
                "=> mixed: {m} registration works for the first {direct_len} bytes; the rest \
                 goes through bounce buffers ({})\n",
                d.reason
            ),
            Some(m) if direct && segments.count() > 1 => format!(
                "=> direct: {m} registration works, as {} MRs of at most {} bytes ({})\n",
                segments.count(),
                segments.segment,
                d.reason
            ),
            Some(m) if direct => format!("=> direct: {m} registration works\n"),
            _ if d.attempts.is_empty() => format!("=> {}\n", d.reason),
            _ => format!(
                "=> no direct strategy works: served through bounce buffers (copy engine: {})\n",
                provider.copy_engine()
            ),
        });
        emit(&o)?;
    }
    if direct {
        Ok(())
    } else if d.attempts.is_empty() {
        // nothing was attempted (the policy said bounce): say why
        Err(anyhow::anyhow!("no direct path: {}", d.reason))
    } else {
        Err(anyhow::anyhow!(
            "no registration strategy passed: {}",
            d.attempts
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        ))
    }
}

pub(crate) fn devices(json: bool) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let devs = verbs::devices()?;
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&devs)?))?;
    }
    if devs.is_empty() {
        return Err(verbs::no_device_error().into());
    }
    if json {
        return Ok(());
    }
    let mut o = String::new();
    for d in &devs {
        writeln!(
            o,
            "{}  node GUID {}  vendor {:#x}:{}  fw {}{}",
            d.name,
            d.node_guid,
            d.vendor_id,
            d.vendor_part_id,
            if d.fw_ver.is_empty() { "-" } else { &d.fw_ver },
            if d.software {
                "  (software RDMA: its DMA is CPU copies in the kernel)"
            } else {
                ""
            }
        )?;
        let c = &d.caps;
        writeln!(o,
            "  caps: max MR {}, {} MRs, {} QPs x {} WRs, {} CQEs, {} SGEs, rd_atom {}/{}, atomics {}",
            human(c.max_mr_size),
            c.max_mr,
            c.max_qp,
            c.max_qp_wr,
            c.max_cqe,
            c.max_sge,
            c.max_qp_rd_atom,
            c.max_qp_init_rd_atom,
            c.atomic
        )?;
        writeln!(
            o,
            "  ODP: {}",
            if !c.odp.supported {
                "not supported".to_string()
            } else {
                format!(
                    "supported{} (RC: read {}, write {}, send {}, recv {})",
                    if c.odp.implicit { ", implicit" } else { "" },
                    c.odp.rc_read,
                    c.odp.rc_write,
                    c.odp.rc_send,
                    c.odp.rc_recv
                )
            }
        )?;
        for p in &d.ports {
            writeln!(
                o,
                "  port {}: {} ({}), MTU {} active / {} max, LID {}",
                p.port, p.state, p.link_layer, p.active_mtu, p.max_mtu, p.lid
            )?;
            let default = verbs::pick_gid(&p.gids).map(|g| g.index);
            for g in &p.gids {
                writeln!(
                    o,
                    "  {} GID[{}] {:<40} {:<10} {}",
                    if Some(g.index) == default { "*" } else { " " },
                    g.index,
                    g.gid.to_string(),
                    serde_json::to_value(g.kind)
                        .ok()
                        .and_then(|v| v.as_str().map(String::from))
                        .unwrap_or_default(),
                    g.netdev.as_deref().unwrap_or("-")
                )?;
            }
        }
    }
    o.push_str(
        "\n* the GID a QP uses when nothing else decides: the first RoCE v2 GID with an IPv4 \
         address. serve, fetch, put and bench prefer the RoCE v2 GID that carries the local \
         address of their TCP control connection (so RDMA takes the same interface); \
         --gid-index N overrides both.\n",
    );
    emit(&o)?;
    Ok(())
}
