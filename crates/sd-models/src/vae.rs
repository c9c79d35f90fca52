//! AutoencoderKL (todo).
