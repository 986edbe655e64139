//! Progress on stderr: a bar on a terminal, periodic plain lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
}

impl Progress {
    /// `total` is in the unit of later `set_position` calls (bytes of input).
    pub fn new(total: Option<u64>, quiet: bool) -> Progress {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total.unwrap_or(0));
            let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        Progress { bar, quiet }
    }

    pub fn set_position(&self, pos: u64, message: &str) {
        if let Some(bar) = &self.bar {
            bar.set_position(pos);
            bar.set_message(message.to_string());
        }
    }

    /// A plain status line (only when there is no bar, so logs stay readable).
    pub fn line(&self, text: &str) {
        if self.quiet {
            return;
        }
        match &self.bar {
            Some(_) => {}
            None => tracing::info!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
