//! Byte sizes with K/M/G/T suffixes (powers of 1024), as users type them, and back.

/// Parse "4096", "64K", "1M", "1.5G", "2MiB", "8k". Errors say what is accepted.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty size".into());
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
            "unknown unit '{other}' in '{s}' (use a number with an optional K, M, G or T suffix)"
        ))
        }
    };
    if num.is_empty() {
        return Err(format!("'{s}' has no number (examples: 4096, 64K, 1M, 2G)"));
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("'{s}' is too large"));
    }
    let f: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 64K, 1M, 2G)"))?;
    let v = f * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(format!("'{s}' is out of range"));
    }
    if v.fract() != 0.0 {
        return Err(format!("'{s}' is not a whole number of bytes"));
    }
    Ok(v as u64)
}

/// Throughput in MiB/s (2^20 bytes per second, as perftest's MB/sec); 0 for no time.
pub fn mib_per_sec(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / f64::from(1 << 20)
    } else {
        0.0
    }
}

/// "1.0 MiB" style, for humans.
pub fn human(n: u64) -> String {
    const U: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("2mib"), Ok(2 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size(" 8k "), Ok(8192));
    }

    #[test]
    fn bad_input_is_explained() {
        assert!(parse_size("").is_err());
        assert!(parse_size("M").unwrap_err().contains("no number"));
        assert!(parse_size("12Q").unwrap_err().contains("unknown unit"));
        assert!(parse_size("0.3").unwrap_err().contains("whole number"));
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
        assert!(parse_size("1.2.3M").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(mib_per_sec(3 << 20, 2.0), 1.5);
        assert_eq!(mib_per_sec(1, 0.0), 0.0);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(10), "10 B");
        assert_eq!(human(1 << 20), "1.0 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(human(u64::MAX), "16.0 EiB");
    }
}
