//! `sparrow bench`'s random-gather ceiling: the C program
//! `shared/tools/gather-limit.c`, compiled with the system's `cc` and run
//! here, in the binary (the trainer library shells out to nothing).

use std::path::Path;
use std::process::Command;

use sparrow_trainer::bench::GatherLimit;

/// Compiles `source` into `work` and runs it for `dims`: rows a second,
/// plain and prefetched, per dimension, or the error that stopped it.
pub fn measure(source: &Path, dims: &[usize], work: &Path) -> GatherLimit {
    let mut out = GatherLimit { source: source.display().to_string(), rows_per_sec: Vec::new(), error: None };
    let exe = work.join("gather-limit");
    let compiled = Command::new("cc").arg("-O2").arg("-o").arg(&exe).arg(source).output();
    match compiled {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            out.error = Some(format!("cc failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
            return out;
        }
        Err(e) => {
            out.error = Some(format!("cannot run cc: {e}"));
            return out;
        }
    }
    let run = Command::new(&exe).args(dims.iter().map(|d| d.to_string())).output();
    let text = match run {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => {
            out.error = Some(format!("gather-limit exited with {}", o.status));
            return out;
        }
        Err(e) => {
            out.error = Some(format!("cannot run gather-limit: {e}"));
            return out;
        }
    };
    // Lines: "dim 16 plain     : 5.0 M rows/s, 0.32 GB/s" / "dim 16 prefetched: 84.5 M rows/s, …"
    for &dim in dims {
        let figure = |kind: &str| {
            text.lines()
                .find(|l| l.starts_with(&format!("dim {dim} {kind}")))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
                .map(|m| m * 1e6)
        };
        if let (Some(plain), Some(pf)) = (figure("plain"), figure("prefetched")) {
            out.rows_per_sec.push((dim, plain, pf));
        }
    }
    if out.rows_per_sec.is_empty() {
        out.error = Some(format!("could not read gather-limit output: {text}"));
    }
    out
}
