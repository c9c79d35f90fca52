//! `sd`: the sd-rs command-line tool.
//!
//! This first version lists the compute devices ggml sees (`--list-devices`) and runs a
//! tensor self-check on the CPU backend (`--self-check`); image generation arrives with the
//! SD1.x pipeline.

use std::process::ExitCode;

use sd_tensor::ggml::{Backend, BufferType, Context, Device, Gallocr, Graph};
use sd_tensor::DType;

const USAGE: &str = "usage: sd [--list-devices] [--self-check] [-t THREADS] [-v] [--version]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut list = false;
    let mut check = false;
    let mut threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--list-devices" => list = true,
            "--self-check" => check = true,
            "-v" | "--verbose" => {}
            "--version" => {
                println!(
                    "sd {} (ggml {})",
                    env!("CARGO_PKG_VERSION"),
                    sd_tensor::ggml::version()
                );
                return ExitCode::SUCCESS;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "-t" | "--threads" => {
                i += 1;
                match args
                    .get(i)
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|&n| n > 0)
                {
                    Some(n) => threads = n,
                    None => {
                        eprintln!("error: -t/--threads needs a positive integer");
                        return ExitCode::from(2);
                    }
                }
            }
            other => {
                eprintln!("error: unknown argument '{other}'\n{USAGE}");
                return ExitCode::from(2);
            }
        }
        i += 1;
    }
    if !list && !check {
        list = true;
    }
    if list {
        list_devices();
    }
    if check {
        if let Err(e) = self_check(threads) {
            eprintln!("error: self-check failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn list_devices() {
    println!(
        "ggml {}: {} device(s)",
        sd_tensor::ggml::version(),
        Device::all().len()
    );
    for d in Device::all() {
        let m = d.memory();
        println!(
            "  {:<8} {:?}  {}  free {} MiB / total {} MiB",
            d.name(),
            d.kind(),
            d.description(),
            m.free >> 20,
            m.total >> 20
        );
    }
}

/// Multiplies two small matrices on the CPU backend and checks the result.
fn self_check(threads: usize) -> Result<(), sd_tensor::GgmlError> {
    let ctx = Context::new_descriptors(8, 8, 1)?;
    let a = ctx.new_tensor(DType::F32, &[16, 8])?;
    let b = ctx.new_tensor(DType::F32, &[16, 4])?;
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx)?;
    let av: Vec<f32> = (0..128).map(|i| (i % 7) as f32).collect();
    let bv: Vec<f32> = (0..64).map(|i| (i % 5) as f32).collect();
    a.write_f32(&av)?;
    b.write_f32(&bv)?;
    let c = ctx.mul_mat(&a, &b)?;
    c.set_output();
    let mut g = Graph::new(&ctx, 8)?;
    g.build_forward_expand(&c)?;
    let backend = Backend::cpu(threads)?;
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&g)?;
    backend.compute(&g)?;
    let got = c.read_f32()?;
    for j in 0..4 {
        for i in 0..8 {
            let want: f32 = (0..16).map(|k| av[i * 16 + k] * bv[j * 16 + k]).sum();
            if (got[j * 8 + i] - want).abs() > 1e-4 {
                return Err(sd_tensor::GgmlError::Mismatch(format!(
                    "c[{j},{i}] = {} != {want}",
                    got[j * 8 + i]
                )));
            }
        }
    }
    println!(
        "self-check: 8x16 @ 16x4 matmul on {} ({} threads) ok",
        backend.name(),
        threads
    );
    Ok(())
}
