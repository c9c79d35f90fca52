//! Align Your Steps noise levels (NVIDIA, <https://research.nvidia.com/labs/toronto-ai/AlignYourSteps/>)
//! and their log-linear stretching to other step counts, as stable-diffusion.cpp uses them.

/// Which Align Your Steps table to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AysTable {
    /// SD1.x table (sd.cpp also falls back to it, with a warning, for SD2.x).
    Sd15,
    /// SDXL table.
    Sdxl,
    /// Stable Video Diffusion table.
    Svd,
}

const SD15: [f64; 11] = [
    14.6146412293,
    6.4745760956,
    3.8636745985,
    2.6946151520,
    1.8841921177,
    1.3943805092,
    0.9642583904,
    0.6523686016,
    0.3977456272,
    0.1515232662,
    0.0291671582,
];

const SDXL: [f64; 11] = [
    14.6146412293,
    6.3184485287,
    3.7681790315,
    2.1811480769,
    1.3405244945,
    0.8620721141,
    0.5550693289,
    0.3798540708,
    0.2332364134,
    0.1114188177,
    0.0291671582,
];

const SVD: [f64; 11] = [
    700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.002,
];

impl AysTable {
    /// The 11 reference noise levels (10 steps), descending.
    pub fn levels(self) -> &'static [f64; 11] {
        match self {
            AysTable::Sd15 => &SD15,
            AysTable::Sdxl => &SDXL,
            AysTable::Svd => &SVD,
        }
    }
}

/// `n + 1` sigmas for `n` steps: the table stretched by log-linear interpolation over a uniform
/// `[0, 1]` grid, the last set to 0.
pub(crate) fn ays_sigmas(table: AysTable, n: usize) -> Vec<f32> {
    let levels = table.levels();
    let mut out: Vec<f32> = if n + 1 == levels.len() {
        levels.iter().map(|&v| v as f32).collect()
    } else {
        log_linear_interpolation(levels, n + 1)
    };
    out[n] = 0.0;
    out
}

/// Resample the descending `sigmas` to `len` values, interpolating `ln(sigma)` linearly.
fn log_linear_interpolation(sigmas: &[f64], len: usize) -> Vec<f32> {
    let m = sigmas.len();
    let logs: Vec<f64> = sigmas.iter().map(|s| s.ln()).collect();
    (0..len)
        .map(|i| {
            let x = if len == 1 {
                0.0
            } else {
                i as f64 / (len - 1) as f64
            };
            let pos = x * (m - 1) as f64;
            let j = (pos.floor() as usize).min(m - 2);
            let w = pos - j as f64;
            ((1.0 - w) * logs[j] + w * logs[j + 1]).exp() as f32
        })
        .collect()
}
