//! `--rng std_default`: [`StdDefaultRng`] against stable-diffusion.cpp's `STDDefaultRNG`
//! compiled with g++ (libstdc++), bit for bit: the fixture is the output of
//! `scripts/fixtures/std_rng/std_default_rng.cpp` (`make_std_rng_fixture.sh`).

use sd_pipeline::rng::{Rng, RngKind, StdDefaultRng};

fn fixture() -> String {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/std_default_rng.txt");
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn randn_calls_equal_libstdcxx_bit_for_bit() {
    let text = fixture();
    let mut current: Option<(u64, StdDefaultRng)> = None;
    let mut lines = 0;
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("hash"))
    {
        let mut f = line.split_whitespace();
        let seed: u64 = f.next().unwrap().parse().unwrap();
        let n: usize = f.next().unwrap().parse().unwrap();
        let want: Vec<u32> = f.map(|h| u32::from_str_radix(h, 16).unwrap()).collect();
        assert_eq!(want.len(), n, "{line}");
        if current.as_ref().is_none_or(|(s, _)| *s != seed) {
            current = Some((seed, StdDefaultRng::new(seed)));
        }
        let rng = &mut current.as_mut().unwrap().1;
        let got: Vec<u32> = rng.randn(n).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "seed {seed}, randn({n})");
        lines += 1;
    }
    assert_eq!(lines, 24);
}

#[test]
fn a_long_stream_hashes_as_libstdcxx() {
    let text = fixture();
    let line = text.lines().find(|l| l.starts_with("hash ")).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    let (seed, n) = (f[1].parse::<u64>().unwrap(), f[2].parse::<usize>().unwrap());
    let want = u64::from_str_radix(f[3], 16).unwrap();
    let mut rng = RngKind::StdDefault.create(seed);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in rng.randn(n) {
        for b in v.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    assert_eq!(h, want, "FNV-1a of randn({n}) with seed {seed}");
}

#[test]
fn the_seed_is_cast_to_unsigned_int() {
    // sd.cpp seeds with `(unsigned int)seed`: 2^32 + 5 is seed 5.
    let a = StdDefaultRng::new(5).randn(9);
    let b = StdDefaultRng::new((1u64 << 32) + 5).randn(9);
    assert_eq!(a, b);
    assert_eq!(
        "std_default".parse::<RngKind>().unwrap(),
        RngKind::StdDefault
    );
}
