//! UNet (todo).
