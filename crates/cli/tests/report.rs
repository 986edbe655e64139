//! `sparrow report` writes one self-contained page whose plots a browser
//! draws: rendered by headless Chromium, the series' lines cover pixels that
//! the same page without its lines leaves blank.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{generate, last_json, sparrow, write_config};

/// The Chromium binary (Debian's `chromium`; `.ci/run` installs it).
fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("sh").args(["-c", &format!("command -v {name}")]).output()
            && out.status.success()
        {
            return PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        }
    }
    panic!("no chromium on PATH: the report test renders the page in it (scripts/ensure-chromium installs it)");
}

/// The page rendered by headless Chromium: (width, height, RGB pixels).
fn render(html: &Path, png: &Path) -> (u32, u32, Vec<u8>) {
    let out = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,1100"])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("chromium");
    assert!(out.status.success() && png.is_file(), "{}", String::from_utf8_lossy(&out.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).expect("png")));
    let mut reader = decoder.read_info().expect("png header");
    let mut pixels = vec![0; reader.output_buffer_size().expect("size")];
    let info = reader.next_frame(&mut pixels).expect("png frame");
    pixels.truncate(info.buffer_size());
    let rgb = match info.color_type {
        png::ColorType::Rgb => pixels,
        png::ColorType::Rgba => pixels.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect(),
        other => panic!("a screenshot in {other:?}"),
    };
    (info.width, info.height, rgb)
}

/// Pixels within a small distance of `rgb`.
fn count(pixels: &[u8], rgb: [u8; 3]) -> usize {
    pixels.chunks_exact(3).filter(|p| (0..3).all(|i| p[i].abs_diff(rgb[i]) <= 12)).count()
}

#[test]
fn a_report_draws_its_plots_in_a_browser() {
    let tmp = tempfile::tempdir().expect("tmp");
    generate(tmp.path(), "20000");
    let data = tmp.path().join("data");
    let config = write_config(tmp.path(), "");
    let metrics = |name: &str| data.join(format!("{name}.jsonl")).display().to_string();
    for (name, extra) in [("base", "model.hidden=[32, 16]"), ("wide", "model.hidden=[64, 32]")] {
        let out = sparrow()
            .args(["train", "--config", &config, "--quiet"])
            .args(["--set", &format!("train.metrics_path={:?}", metrics(name)), "--set", extra])
            .args(["--set", "train.log_interval_steps=5", "--set", "train.eval_every_steps=20"])
            .output()
            .expect("train");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let html = tmp.path().join("report.html");
    let out = sparrow()
        .args(["report", "--metrics", &metrics("base"), "--compare", &metrics("wide")])
        .args(["--out", &html.display().to_string()])
        .output()
        .expect("report");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary = last_json(&out);
    assert_eq!((summary["runs"].as_u64(), summary["plots"].as_u64()), (Some(2), Some(4)));

    let page = std::fs::read_to_string(&html).expect("html");
    for outside in ["http://", "https://", "<script", "<link", "src="] {
        assert!(!page.contains(outside), "self-contained: `{outside}` found");
    }
    assert!(page.contains("best possible (truth.json)"), "truth.json beside the metrics gives the Bayes line");
    // Every test point: at steps 20, 40, 60 and the end (79), for each run.
    assert_eq!(page.matches(r#"<circle "#).count(), 8);

    let (w, h, drawn) = render(&html, &tmp.path().join("drawn.png"));
    assert!(w >= 1200 && h >= 1000);
    // The same page without its lines: the difference is what the lines drew.
    let bare = tmp.path().join("bare.html");
    let mut without = String::new();
    for part in page.split("<polyline ") {
        match part.split_once("/>") {
            Some((_, rest)) if !without.is_empty() => without.push_str(rest),
            _ => without.push_str(part),
        }
    }
    assert!(!without.contains("<polyline"));
    std::fs::write(&bare, without).expect("bare");
    let (_, _, blank) = render(&bare, &tmp.path().join("bare.png"));
    for (run, rgb) in [("base", [0x1f, 0x77, 0xb4]), ("wide", [0xff, 0x7f, 0x0e])] {
        let (with, without) = (count(&drawn, rgb), count(&blank, rgb));
        assert!(with > without + 1500, "{run}'s lines: {with} pixels drawn, {without} without the lines");
    }
}
