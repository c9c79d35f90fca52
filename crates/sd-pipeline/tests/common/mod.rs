//! Helpers shared by the sd-pipeline tests (each test binary uses some of them).
#![allow(dead_code)]

pub mod files;
pub mod reference;
pub mod sim;
