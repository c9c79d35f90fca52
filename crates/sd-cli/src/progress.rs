//! Progress on stderr: a bar redrawn in place when stderr is a terminal, nothing otherwise
//! (with `-v`, one line per event instead).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Progress of one phase (`loading`, `image 1/2`...).
pub struct Progress {
    tty: bool,
    verbose: bool,
    start: Instant,
    phase_start: Instant,
    label: String,
    drawn: bool,
}

const WIDTH: usize = 30;

impl Progress {
    /// A reporter: a bar when stderr is a terminal, lines when `verbose`.
    pub fn new(verbose: bool) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            verbose,
            start: Instant::now(),
            phase_start: Instant::now(),
            label: String::new(),
            drawn: false,
        }
    }

    /// Seconds since the reporter was created.
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Starts a phase named `label`.
    pub fn phase(&mut self, label: impl Into<String>) {
        self.finish_line();
        self.label = label.into();
        self.phase_start = Instant::now();
        if self.verbose {
            eprintln!("{} ({:.1} s)", self.label, self.elapsed());
        }
    }

    /// Reports `done` of `total` units of the current phase.
    pub fn update(&mut self, done: usize, total: usize, unit: &str) {
        if self.verbose {
            eprintln!(
                "{} {unit} {done}/{total} ({:.1} s)",
                self.label,
                self.elapsed()
            );
            return;
        }
        if !self.tty {
            return;
        }
        let total_n = total.max(1);
        let filled = (done.min(total_n) * WIDTH) / total_n;
        let secs = self.phase_start.elapsed().as_secs_f64();
        let rate = if done > 0 {
            format!("{:.2} s/{}", secs / done as f64, unit.trim_end_matches('s'))
        } else {
            String::new()
        };
        eprint!(
            "\r{:<12} [{}{}] {done}/{total} {unit} {rate}   ",
            self.label,
            "=".repeat(filled),
            " ".repeat(WIDTH - filled)
        );
        let _ = std::io::stderr().flush();
        self.drawn = true;
    }

    /// Ends the bar's line, if one is drawn.
    pub fn finish_line(&mut self) {
        if self.drawn {
            eprintln!();
            self.drawn = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish_line();
    }
}
