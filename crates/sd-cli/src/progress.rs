//! Progress on stderr: an `indicatif` bar when stderr is a terminal, otherwise a plain line
//! at the end of each phase (and every 10% of the sampling steps).

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

/// Progress of one phase at a time (`loading`, `image 1/2`, `upscaling`...).
pub struct Progress {
    tty: bool,
    start: Instant,
    bar: Option<ProgressBar>,
    label: String,
    unit: String,
    last_decile: usize,
}

impl Progress {
    /// A reporter on stderr.
    pub fn new() -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            start: Instant::now(),
            bar: None,
            label: String::new(),
            unit: String::new(),
            last_decile: 0,
        }
    }

    /// Seconds since the reporter was created.
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Starts a phase named `label` counting `unit`s.
    pub fn phase(&mut self, label: impl Into<String>, unit: &str) {
        self.finish();
        self.label = label.into();
        self.unit = unit.to_string();
        self.last_decile = 0;
        tracing::info!(phase = %self.label, "start");
        if self.tty {
            let bar = ProgressBar::new(0);
            let style = ProgressStyle::with_template(
                "{msg:<12} [{bar:30}] {pos}/{len} {prefix} {elapsed_precise} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_message(self.label.clone());
            bar.set_prefix(self.unit.clone());
            self.bar = Some(bar);
        }
    }

    /// Reports `done` of `total` units of the current phase.
    pub fn update(&mut self, done: usize, total: usize) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            }
            None => {
                let decile = (done * 10).checked_div(total).unwrap_or(10);
                // Sampling steps are slow enough to report every 10%; the rest at the end.
                if decile > self.last_decile && done < total && self.unit == "steps" {
                    self.last_decile = decile;
                    eprintln!(
                        "{}: {done}/{total} {} ({:.1} s)",
                        self.label,
                        self.unit,
                        self.elapsed()
                    );
                }
                if done >= total && self.last_decile < 10 {
                    self.last_decile = 10;
                    eprintln!(
                        "{}: {done}/{total} {} done ({:.1} s)",
                        self.label,
                        self.unit,
                        self.elapsed()
                    );
                }
            }
        }
    }

    /// Ends the current phase's bar.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }

    /// Removes the current bar (on errors, before the message).
    pub fn abandon(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
