//! `sparrow report`: one self-contained HTML page (inline SVG and CSS, no
//! script, nothing fetched) from runs' `train.metrics_path` files: the
//! training log-loss, the test AUC (with the best possible AUC when the data's
//! `truth.json` is known) and the throughput over samples trained, and where
//! a step's time goes, for one run or several side by side.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}:{line}: {message}")]
    Line { path: PathBuf, line: usize, message: String },
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
}

/// The phases of a training step, as `train`'s metrics name them.
const PHASES: [&str; 6] = ["lookup", "pool", "dense", "unpool", "update", "next_batch"];
const COLORS: [&str; 8] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// One logging interval of a run.
#[derive(Clone, Debug)]
struct Interval {
    step: u64,
    samples: f64,
    logloss: f64,
    rate: f64,
    /// Seconds per phase since the run began (None in older metrics files).
    phases: Option<[f64; 6]>,
    /// Progressive validation over the window (`online_window`): AUC,
    /// normalized entropy, calibration; None when it is off.
    online: Option<[f64; 3]>,
}

#[derive(Clone, Debug)]
struct Eval {
    step: u64,
    samples: f64,
    auc: f64,
    logloss: f64,
    /// Each task's figures, where the line has `tasks` (several tasks, or
    /// `eval.group_by`).
    tasks: Vec<(String, TaskPoint)>,
}

/// One task's figures on an eval line: its AUC (a multiclass task's macro
/// AUC); a binary task's normalized entropy and calibration (NaN: absent).
#[derive(Clone, Copy, Debug, PartialEq)]
struct TaskPoint {
    auc: f64,
    ne: f64,
    calibration: f64,
}

/// One run's metrics file.
#[derive(Clone, Debug)]
pub struct Run {
    pub name: String,
    intervals: Vec<Interval>,
    evals: Vec<Eval>,
}

impl Run {
    /// Reads a metrics file (JSON lines: interval lines and `eval` lines).
    pub fn read(path: &Path) -> Result<Run, ReportError> {
        let text = std::fs::read_to_string(path).map_err(|error| ReportError::Io { path: path.into(), error })?;
        let (mut intervals, mut evals) = (Vec::new(), Vec::new());
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = |message: String| ReportError::Line { path: path.into(), line: i + 1, message };
            let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not a JSON line: {e}")))?;
            let number = |key: &str| v.get(key).and_then(Value::as_f64);
            let step = v.get("step").and_then(Value::as_u64).ok_or_else(|| bad("no `step`".into()))?;
            if v.get("event").and_then(Value::as_str) == Some("eval") {
                let (Some(auc), Some(logloss)) = (number("test_auc"), number("test_logloss")) else { continue };
                // Older files: no `samples` on eval lines; the interval of that step has them.
                let samples = number("samples")
                    .or_else(|| intervals.iter().rev().find(|x: &&Interval| x.step <= step).map(|x| x.samples))
                    .unwrap_or(0.0);
                let tasks = v
                    .get("tasks")
                    .and_then(Value::as_object)
                    .map(|t| {
                        t.iter()
                            .filter_map(|(name, f)| {
                                let auc = f.get("auc").or_else(|| f.get("macro_auc")).and_then(Value::as_f64)?;
                                let figure = |k: &str| f.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
                                let point = TaskPoint { auc, ne: figure("ne"), calibration: figure("calibration") };
                                Some((name.clone(), point))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                evals.push(Eval { step, samples, auc, logloss, tasks });
            } else {
                let (Some(samples), Some(rate)) = (number("samples"), number("samples_per_sec")) else {
                    return Err(bad("an interval line needs `samples` and `samples_per_sec`".into()));
                };
                // A diverged interval's loss is written as null: a gap in the curve.
                let logloss = number("train_logloss").unwrap_or(f64::NAN);
                let phases =
                    v.get("phase_secs").map(|p| PHASES.map(|k| p.get(k).and_then(Value::as_f64).unwrap_or(0.0)));
                let online = v.get("online_window").filter(|o| o.is_object()).map(|o| {
                    ["auc", "normalized_entropy", "calibration"]
                        .map(|k| o.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN))
                });
                intervals.push(Interval { step, samples, logloss, rate, phases, online });
            }
        }
        if intervals.is_empty() && evals.is_empty() {
            return Err(ReportError::Input {
                path: path.into(),
                message: "holds no metrics line (set train.metrics_path and train a while)".into(),
            });
        }
        Ok(Run { name: run_name(path), intervals, evals })
    }
}

/// A run's name: the metrics file's directory and stem (`demo-data/metrics`).
fn run_name(path: &Path) -> String {
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    match path.parent().and_then(Path::file_name) {
        Some(dir) => format!("{}/{stem}", dir.to_string_lossy()),
        None => stem,
    }
}

/// What `sparrow report` prints.
#[derive(Debug, serde::Serialize)]
pub struct ReportSummary {
    pub report: String,
    pub runs: usize,
    pub plots: usize,
    pub bytes: usize,
}

/// The best possible AUC of generated data (`truth.json`'s `bayes_auc`).
pub fn bayes_auc(truth: &Path) -> Result<f64, ReportError> {
    let text = std::fs::read_to_string(truth).map_err(|error| ReportError::Io { path: truth.into(), error })?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| ReportError::Input { path: truth.into(), message: format!("not JSON: {e}") })?;
    v.get("bayes_auc")
        .and_then(Value::as_f64)
        .ok_or_else(|| ReportError::Input { path: truth.into(), message: "has no `bayes_auc`".into() })
}

/// Writes the report of `metrics` (the first is the run, the others
/// compared with it) to `out`. `truth`: the data's `truth.json` (default:
/// one beside the first metrics file, if there is one).
pub fn write_report(
    metrics: &[PathBuf],
    truth: Option<&Path>,
    title: Option<&str>,
    out: &Path,
) -> Result<ReportSummary, ReportError> {
    let runs = metrics.iter().map(|p| Run::read(p)).collect::<Result<Vec<_>, _>>()?;
    let beside = metrics.first().and_then(|m| m.parent()).map(|d| d.join("truth.json")).filter(|t| t.is_file());
    let bayes = match truth {
        Some(t) => Some(bayes_auc(t)?),
        None => beside.as_deref().map(bayes_auc).transpose()?,
    };
    let (html, plots) = render(&runs, bayes, title.unwrap_or("Sparrow run report"));
    std::fs::write(out, &html).map_err(|error| ReportError::Io { path: out.into(), error })?;
    Ok(ReportSummary { report: out.display().to_string(), runs: runs.len(), plots, bytes: html.len() })
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

struct Series<'a> {
    name: &'a str,
    color: &'a str,
    points: Vec<(f64, f64)>,
    markers: bool,
}

/// About five round tick values covering [lo, hi].
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| span / s <= 6.0).unwrap_or(magnitude);
    let first = (lo / step).ceil() * step;
    (0..=12).map(|i| first + i as f64 * step).take_while(|t| *t <= hi + step * 1e-9).collect()
}

/// A tick's text: as many decimals as the tick `step` needs, in k or M
/// for large values.
fn label(x: f64, step: f64) -> String {
    if x.abs() < step * 1e-9 {
        return "0".into();
    }
    let (unit, suffix) = match x.abs().max(step) {
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e4 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let decimals = (-(step / unit).log10().floor()).clamp(0.0, 6.0) as usize;
    format!("{:.*}{suffix}", decimals, x / unit)
}

const W: f64 = 600.0;
const H: f64 = 330.0;
// Margins: left (tick labels), right, top (title), bottom (axis name).
const L: f64 = 70.0;
const R: f64 = 20.0;
const T: f64 = 34.0;
const B: f64 = 48.0;

/// An SVG line chart; `reference`: a dashed horizontal line and its label.
fn line_chart(
    id: &str,
    title: &str,
    x_name: &str,
    y_name: &str,
    series: &[Series],
    reference: Option<(f64, &str)>,
) -> String {
    let mut svg = format!(
        r#"<svg class="plot" data-plot="{id}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{t}"><text class="title" x="{L}" y="20">{t}</text>"#,
        t = escape(title)
    );
    // Non-finite points (a diverged interval) are left out.
    let series: Vec<Series> = series
        .iter()
        .map(|s| Series {
            name: s.name,
            color: s.color,
            points: s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect(),
            markers: s.markers,
        })
        .collect();
    let series = &series[..];
    let points: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    if points.is_empty() {
        let _ = write!(
            svg,
            r#"<text class="empty" x="{}" y="{}">no data in these runs</text></svg>"#,
            W / 2.0 - 70.0,
            H / 2.0
        );
        return svg;
    }
    let (mut x0, mut x1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let ys = points.iter().map(|p| p.1).chain(reference.map(|r| r.0));
    let (mut y0, mut y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    if x1 - x0 < 1e-12 {
        // One point (a single evaluation): a window around it.
        let half = (x0.abs() * 0.1).max(1.0);
        (x0, x1) = (x0 - half, x1 + half);
    }
    let pad = ((y1 - y0) * 0.08).max(1e-6);
    (y0, y1) = (y0 - pad, y1 + pad);
    let sx = |x: f64| L + (x - x0) / (x1 - x0) * (W - L - R);
    let sy = |y: f64| H - B - (y - y0) / (y1 - y0) * (H - T - B);
    let y_ticks = ticks(y0, y1);
    let y_step = y_ticks.get(1).zip(y_ticks.first()).map_or(1.0, |(b, a)| b - a);
    for t in y_ticks {
        let _ = write!(
            svg,
            r#"<line class="grid" x1="{L}" x2="{}" y1="{y:.1}" y2="{y:.1}"/><text class="tick" x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            W - R,
            L - 6.0,
            sy(t) + 4.0,
            label(t, y_step),
            y = sy(t)
        );
    }
    let x_ticks = ticks(x0, x1);
    let x_step = x_ticks.get(1).zip(x_ticks.first()).map_or(1.0, |(b, a)| b - a);
    for t in x_ticks {
        let _ = write!(
            svg,
            r#"<line class="grid" x1="{x:.1}" x2="{x:.1}" y1="{T}" y2="{}"/><text class="tick" x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
            H - B,
            H - B + 16.0,
            label(t, x_step),
            x = sx(t)
        );
    }
    let _ = write!(
        svg,
        r#"<line class="axis" x1="{L}" x2="{L}" y1="{T}" y2="{hb}"/><line class="axis" x1="{L}" x2="{wr}" y1="{hb}" y2="{hb}"/><text class="axis-name" x="{}" y="{}" text-anchor="middle">{}</text><text class="axis-name" transform="translate(16 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (L + W - R) / 2.0,
        H - 10.0,
        escape(x_name),
        (T + H - B) / 2.0,
        escape(y_name),
        hb = H - B,
        wr = W - R
    );
    if let Some((y, name)) = reference {
        let _ = write!(
            svg,
            r#"<line class="reference" x1="{L}" x2="{}" y1="{yy:.1}" y2="{yy:.1}"/><text class="reference-label" x="{}" y="{:.1}">{}</text>"#,
            W - R,
            L + 6.0,
            sy(y) - 5.0,
            escape(&format!("{name} {y:.4}")),
            yy = sy(y)
        );
    }
    for s in series {
        let path: Vec<String> = s.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        let _ = write!(
            svg,
            r#"<polyline class="series" data-points="{}" fill="none" stroke="{}" stroke-width="2.5" points="{}"/>"#,
            s.points.len(),
            s.color,
            path.join(" ")
        );
        if s.markers {
            for &(x, y) in &s.points {
                let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#, sx(x), sy(y), s.color);
            }
        }
    }
    for (i, s) in series.iter().enumerate() {
        let y = T + 8.0 + 16.0 * i as f64;
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="12" height="4" fill="{}"/><text class="legend" x="{}" y="{}" text-anchor="end">{}</text>"#,
            W - R - 14.0,
            y - 4.0,
            s.color,
            W - R - 18.0,
            y + 1.0,
            escape(s.name)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// Milliseconds per step in each phase, one stacked bar per run.
fn phase_chart(runs: &[Run]) -> String {
    let bars: Vec<(&str, [f64; 6])> = runs
        .iter()
        .filter_map(|r| {
            let last = r.intervals.iter().rev().find(|i| i.phases.is_some())?;
            let phases = last.phases?;
            Some((r.name.as_str(), phases.map(|s| s / last.step.max(1) as f64 * 1e3)))
        })
        .collect();
    let height = T + B + 40.0 * bars.len().max(1) as f64;
    let mut svg = format!(
        r#"<svg class="plot" data-plot="phases" viewBox="0 0 {W} {height}" width="{W}" height="{height}" role="img" aria-label="step phases"><text class="title" x="{L}" y="20">Where a training step's time goes (ms per step)</text>"#
    );
    if bars.is_empty() {
        let _ =
            write!(svg, r#"<text class="empty" x="{}" y="{}">no phase times in these runs</text></svg>"#, L, T + 30.0);
        return svg;
    }
    let total = bars.iter().map(|(_, p)| p.iter().sum::<f64>()).fold(0.0, f64::max).max(1e-9);
    let left = 150.0;
    // Room on the right for the total's label.
    let scale = (W - left - R - 70.0) / total;
    for (i, (name, phases)) in bars.iter().enumerate() {
        let y = T + 14.0 + 40.0 * i as f64;
        let _ = write!(
            svg,
            r#"<text class="tick" x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 6.0,
            y + 15.0,
            escape(name)
        );
        let mut x = left;
        for (k, ms) in phases.iter().enumerate() {
            let w = ms * scale;
            let _ = write!(
                svg,
                r#"<rect class="phase" data-phase="{}" x="{x:.1}" y="{y}" width="{w:.1}" height="22" fill="{}"><title>{}: {ms:.3} ms</title></rect>"#,
                PHASES[k], COLORS[k], PHASES[k]
            );
            x += w;
        }
        let _ = write!(
            svg,
            r#"<text class="tick" x="{:.1}" y="{}">{:.3} ms</text>"#,
            x + 4.0,
            y + 15.0,
            phases.iter().sum::<f64>()
        );
    }
    // The legend across the whole width: six phases do not fit right of the bars' labels.
    let spacing = (W - 2.0 * 20.0) / PHASES.len() as f64;
    for (k, phase) in PHASES.iter().enumerate() {
        let x = 20.0 + spacing * k as f64;
        let y = height - 18.0;
        let _ = write!(
            svg,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text class="legend" x="{}" y="{y}">{phase}</text>"#,
            y - 10.0,
            COLORS[k],
            x + 16.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// The page and how many plots it holds.
fn render(runs: &[Run], bayes: Option<f64>, title: &str) -> (String, usize) {
    let color = |i: usize| COLORS[i % COLORS.len()];
    let series = |f: &dyn Fn(&Run) -> Vec<(f64, f64)>, markers: bool| -> Vec<Series> {
        runs.iter().enumerate().map(|(i, r)| Series { name: &r.name, color: color(i), points: f(r), markers }).collect()
    };
    let loss = series(&|r| r.intervals.iter().map(|i| (i.samples, i.logloss)).collect(), false);
    let auc = series(&|r| r.evals.iter().map(|e| (e.samples, e.auc)).collect(), true);
    let rate = series(&|r| r.intervals.iter().map(|i| (i.samples, i.rate)).collect(), false);
    let mut plots = vec![
        line_chart("loss", "Training log-loss", "samples trained", "log-loss (interval mean)", &loss, None),
        line_chart("auc", "Test AUC", "samples trained", "AUC", &auc, bayes.map(|b| (b, "best possible (truth.json)"))),
        line_chart("throughput", "Throughput", "samples trained", "samples/s", &rate, None),
        phase_chart(runs),
    ];
    // Several tasks: each one's test AUC (a multiclass task's macro AUC).
    let task_names: Vec<(usize, String, String)> = runs
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            let names: std::collections::BTreeSet<&str> =
                r.evals.iter().flat_map(|e| e.tasks.iter().map(|(n, _)| n.as_str())).collect();
            names.into_iter().map(move |n| (i, n.to_string(), format!("{}: {n}", r.name))).collect::<Vec<_>>()
        })
        .collect();
    if task_names.len() > runs.len() {
        // One curve per (run, task) with the figure `pick` reads, where it has one.
        let per_task = |pick: fn(&TaskPoint) -> f64| -> Vec<Series> {
            task_names
                .iter()
                .enumerate()
                .map(|(k, (i, task, name))| Series {
                    name,
                    color: color(k),
                    points: runs[*i]
                        .evals
                        .iter()
                        .filter_map(|e| Some((e.samples, pick(&e.tasks.iter().find(|(n, _)| n == task)?.1))))
                        .filter(|(_, v)| v.is_finite())
                        .collect(),
                    markers: true,
                })
                .filter(|s| !s.points.is_empty())
                .collect()
        };
        let title = "Test AUC per task (multiclass: macro AUC)";
        plots.push(line_chart("task-auc", title, "samples trained", "AUC", &per_task(|p| p.auc), None));
        let ne = per_task(|p| p.ne);
        if !ne.is_empty() {
            let title = "Normalized entropy per binary task (log-loss over the base rate's entropy; lower is better)";
            plots.push(line_chart("task-ne", title, "samples trained", "normalized entropy", &ne, None));
        }
        let calibration = per_task(|p| p.calibration);
        if !calibration.is_empty() {
            let title = "Calibration per binary task (predicted over observed positives; 1 is calibrated)";
            plots.push(line_chart("task-calibration", title, "samples trained", "calibration", &calibration, None));
        }
    }
    // Progressive validation (train.online_window_samples), when a run has it.
    if runs.iter().any(|r| r.intervals.iter().any(|i| i.online.is_some())) {
        let online =
            |k: usize| series(&|r| r.intervals.iter().filter_map(|i| Some((i.samples, i.online?[k]))).collect(), false);
        let titles = [
            ("online-auc", "Online AUC (scored before training, window)", "AUC"),
            ("online-ne", "Online normalized entropy (window)", "log-loss / entropy of the base rate"),
            ("online-calibration", "Online calibration (window)", "Σ predictions / Σ labels"),
        ];
        for (k, (id, title, y)) in titles.into_iter().enumerate() {
            let reference = (k == 2).then_some((1.0, "calibrated"));
            plots.push(line_chart(id, title, "samples trained", y, &online(k), reference));
        }
    }
    let mut rows = String::new();
    for (i, r) in runs.iter().enumerate() {
        let last = r.intervals.last();
        let eval = r.evals.last();
        let mean_rate = match r.intervals.len() {
            0 => None,
            n => Some(r.intervals.iter().map(|i| i.rate).sum::<f64>() / n as f64),
        };
        let cell = |v: Option<f64>, digits: usize| v.map_or_else(|| "–".to_string(), |v| format!("{v:.digits$}"));
        let _ = write!(
            rows,
            r#"<tr><td><span class="swatch" style="background:{}"></span>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            color(i),
            escape(&r.name),
            // The run's end: its last line, interval or evaluation.
            last.map(|l| l.step).max(eval.map(|e| e.step)).map_or_else(|| "–".into(), |s| s.to_string()),
            cell(last.map(|l| l.samples).into_iter().chain(eval.map(|e| e.samples)).reduce(f64::max), 0),
            cell(last.map(|l| l.logloss), 5),
            cell(eval.map(|e| e.auc), 5),
            cell(eval.map(|e| e.logloss), 5),
            cell(mean_rate, 0),
        );
    }
    let bayes_line = bayes.map_or_else(String::new, |b| {
        format!("<p>Best possible test AUC on this data (the generator's true probabilities, <code>truth.json</code>): <b>{b:.5}</b>.</p>")
    });
    let html = format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }}
h1 {{ font-size: 20px; }}
table {{ border-collapse: collapse; margin: 12px 0 20px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.swatch {{ display: inline-block; width: 10px; height: 10px; margin-right: 6px; }}
.plots {{ display: flex; flex-wrap: wrap; gap: 16px; }}
svg.plot {{ border: 1px solid #e4e4e4; background: #fff; }}
svg .title {{ font-size: 14px; font-weight: 600; }}
svg .tick, svg .legend, svg .reference-label {{ font-size: 11px; fill: #444; }}
svg .axis-name {{ font-size: 12px; fill: #333; }}
svg .grid {{ stroke: #eee; }}
svg .axis {{ stroke: #888; }}
svg .reference {{ stroke: #555; stroke-dasharray: 6 4; }}
svg .empty {{ font-size: 13px; fill: #999; }}
</style></head><body>
<h1>{title}</h1>
<p>{n} run(s). Interval lines: <code>train.log_interval_steps</code>; test points: <code>train.eval_every_steps</code> and the end of each run.</p>
{bayes_line}
<table><tr><th>run</th><th>steps</th><th>samples</th><th>train log-loss</th><th>test AUC</th><th>test log-loss</th><th>mean samples/s</th></tr>{rows}</table>
<div class="plots">{plots}</div>
</body></html>
"#,
        title = escape(title),
        n = runs.len(),
        plots = plots.join("\n"),
    );
    (html, plots.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 1.0), [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]);
        let t = ticks(0.7712, 0.8034);
        assert!(t.len() >= 3 && t[0] >= 0.7712 && *t.last().expect("a tick") <= 0.8034, "{t:?}");
    }

    #[test]
    fn tick_labels_carry_the_decimals_their_step_needs() {
        assert_eq!(label(0.0, 20_000.0), "0");
        assert_eq!(label(40_000.0, 20_000.0), "40k");
        assert_eq!(label(1_050_000.0, 50_000.0), "1.05M");
        assert_eq!(label(0.85, 0.01), "0.85");
        assert_eq!(label(0.8, 0.1), "0.8");
    }

    #[test]
    fn a_malformed_line_is_named_by_file_and_line() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("m.jsonl");
        std::fs::write(&path, "{\"step\":1,\"samples\":10,\"train_logloss\":0.5,\"samples_per_sec\":9}\n{oops\n")
            .expect("write");
        let err = Run::read(&path).expect_err("refused").to_string();
        assert!(err.contains("m.jsonl:2") && err.contains("not a JSON line"), "{err}");
        std::fs::write(&path, "").expect("write");
        assert!(Run::read(&path).expect_err("refused").to_string().contains("no metrics line"));
        // A diverged interval (its loss null) is a gap, not an error.
        std::fs::write(
            &path,
            "{\"step\":1,\"samples\":10,\"train_logloss\":null,\"samples_per_sec\":9}\n\
             {\"step\":2,\"samples\":20,\"train_logloss\":0.5,\"samples_per_sec\":9}\n",
        )
        .expect("write");
        let run = Run::read(&path).expect("read");
        let (html, _) = render(&[run], None, "t");
        assert!(html.contains(r#"data-points="1""#) && !html.contains("NaN"), "{html}");
    }

    /// Progressive-validation lines add the online plots (a null AUC, one
    /// class only so far, is a gap); runs without them get none.
    #[test]
    fn online_metrics_get_their_plots_when_a_run_has_them() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("m.jsonl");
        let line = |step: u64, auc: &str| {
            format!(
                "{{\"step\":{step},\"samples\":{},\"train_logloss\":0.5,\"samples_per_sec\":9,\
                 \"online_window\":{{\"auc\":{auc},\"normalized_entropy\":0.9,\"calibration\":1.1}}}}\n",
                step * 10
            )
        };
        std::fs::write(&path, line(1, "null") + &line(2, "0.71") + &line(3, "0.73")).expect("write");
        let (html, plots) = render(&[Run::read(&path).expect("read")], None, "t");
        assert_eq!(plots, 7);
        let online_auc = html.split(r#"data-plot="online-auc""#).nth(1).expect("the online AUC plot");
        assert!(online_auc.contains(r#"data-points="2""#), "{online_auc}");
        std::fs::write(&path, "{\"step\":1,\"samples\":10,\"train_logloss\":0.5,\"samples_per_sec\":9}\n")
            .expect("write");
        assert_eq!(render(&[Run::read(&path).expect("read")], None, "t").1, 4);
    }

    /// Eval lines with several tasks draw each task's AUC (a multiclass
    /// task's macro AUC) as a curve of its own; one-task runs draw none.
    #[test]
    fn several_tasks_draw_a_curve_each() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("m.jsonl");
        let eval = |step: u64, click: f64, kind: f64| {
            format!(
                "{{\"step\":{step},\"event\":\"eval\",\"samples\":{},\"test_auc\":{click},\"test_logloss\":0.4,\
                 \"tasks\":{{\"click\":{{\"auc\":{click},\"ne\":0.9,\"calibration\":1.1}},\"kind\":{{\"macro_auc\":{kind},\"accuracy\":0.5}}}}}}\n",
                step * 100
            )
        };
        std::fs::write(&path, eval(1, 0.6, 0.7) + &eval(2, 0.65, 0.72)).expect("write");
        let run = Run::read(&path).expect("reads");
        let aucs: Vec<(&str, f64)> = run.evals[1].tasks.iter().map(|(n, p)| (n.as_str(), p.auc)).collect();
        assert_eq!(aucs, [("click", 0.65), ("kind", 0.72)]);
        let (html, _) = render(&[run], None, "t");
        let plot = html.split("data-plot=\"task-auc\"").nth(1).expect("the per-task plot");
        let plot = &plot[..plot.find("</svg>").expect("its end")];
        assert_eq!(plot.matches("class=\"series\" data-points=\"2\"").count(), 2, "{plot}");
        assert!(plot.contains("m: kind"), "{plot}");
        // NE and calibration: the binary task's curve only (the multiclass one has neither).
        for id in ["task-ne", "task-calibration"] {
            let plot = html.split(&format!("data-plot=\"{id}\"")).nth(1).expect("the plot");
            let plot = &plot[..plot.find("</svg>").expect("its end")];
            assert_eq!(plot.matches("class=\"series\" data-points=\"2\"").count(), 1, "{id}: {plot}");
            assert!(plot.contains("m: click") && !plot.contains("m: kind"), "{id}: {plot}");
        }
        std::fs::write(&path, "{\"step\":1,\"event\":\"eval\",\"samples\":9,\"test_auc\":0.6,\"test_logloss\":0.4}\n")
            .expect("write");
        let (html, _) = render(&[Run::read(&path).expect("reads")], None, "t");
        assert!(!html.contains("task-auc"), "no per-task plot for one task");
    }
}
