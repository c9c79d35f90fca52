//! Conditioning weighting math and chunk handling on a toy text encoder.

use std::convert::Infallible;

use sd_pipeline::conditioning::{
    apply_token_weights, encode_cfg, encode_prompt, encode_tokens, infallible, repeat_batch,
    stack_uncond_cond, ConditioningError,
};
use sd_pipeline::tokenizer::{ClipTokenizer, CHUNK_LEN};
use sd_tensor::Tensor;

const HIDDEN: usize = 4;

/// A deterministic toy encoder: element (i, j) depends on the token id, position and channel,
/// and is positive so that means are well away from 0.
fn toy(tokens: &[i32]) -> Tensor<f32> {
    Tensor::from_fn([tokens.len(), HIDDEN], |ix| {
        let (i, j) = (ix[0], ix[1]);
        1.0 + (tokens[i] % 97) as f32 * 0.01 + i as f32 * 0.001 + j as f32 * 0.1
    })
    .expect("shape")
}

#[test]
fn weighting_math() {
    let mut h = Tensor::new([3, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).expect("shape");
    let w = [1.0f32, 2.0, 0.5];
    apply_token_weights(&mut h, &w).expect("weights");
    // Weighted: [1, 2, 6, 8, 2.5, 3] (mean 22.5 / 6 = 3.75); original mean 3.5.
    let s = 3.5f32 / 3.75;
    let expected = [1.0, 2.0, 6.0, 8.0, 2.5, 3.0].map(|v: f32| v * s);
    for (g, e) in h.data().iter().zip(expected) {
        assert!((g - e).abs() < 1e-6, "{g} vs {e}");
    }
    assert!((h.mean() - 3.5).abs() < 1e-6);
}

#[test]
fn unit_weights_are_identity_and_zero_mean_skips_rescale() {
    let data = vec![1.0f32, -2.0, 3.0, 0.5];
    let mut h = Tensor::new([2, 2], data.clone()).expect("shape");
    apply_token_weights(&mut h, &[1.0, 1.0]).expect("weights");
    assert_eq!(h.data(), data.as_slice());

    // Weighted mean 0: only the multiplication is applied.
    let mut h = Tensor::new([2, 1], vec![1.0f32, 2.0]).expect("shape");
    apply_token_weights(&mut h, &[2.0, -1.0]).expect("weights");
    assert_eq!(h.data(), &[2.0, -2.0]);

    let mut h = Tensor::new([2, 2], data).expect("shape");
    assert!(matches!(
        apply_token_weights(&mut h, &[1.0]),
        Err(ConditioningError::WeightCount { .. })
    ));
}

#[test]
fn unweighted_prompt_is_raw_encoder_output() {
    let tok = ClipTokenizer::sd1();
    let prompt = "a photo of a cat";
    let ctx = encode_prompt(&tok, prompt, infallible(toy)).expect("encode");
    let t = tok.tokenize(prompt);
    assert_eq!(ctx.shape(), &[CHUNK_LEN, HIDDEN]);
    assert_eq!(ctx, toy(t.tokens()));
}

#[test]
fn weighted_chunks_are_weighted_per_chunk_and_concatenated() {
    let tok = ClipTokenizer::sd1();
    let long: String = (0..60).map(|i| format!("w{i} ")).collect();
    let prompt = format!("(red cat:1.5), {long}[blurry]");
    let t = tok.tokenize_weighted(&prompt);
    assert!(t.num_chunks() >= 2);
    let mut calls = 0;
    let ctx = encode_tokens(&t, |ids: &[i32]| {
        calls += 1;
        assert_eq!(ids.len(), CHUNK_LEN);
        Ok::<_, Infallible>(toy(ids))
    })
    .expect("encode");
    assert_eq!(calls, t.num_chunks());
    assert_eq!(ctx.shape(), &[t.num_chunks() * CHUNK_LEN, HIDDEN]);
    for (c, (ids, w)) in t.chunks().enumerate() {
        let raw = toy(ids);
        let got = ctx
            .slice(0, c * CHUNK_LEN, (c + 1) * CHUNK_LEN)
            .expect("slice");
        // Reference computed independently in f64.
        let mean0: f64 = raw.data().iter().map(|&v| v as f64).sum::<f64>() / raw.numel() as f64;
        let weighted: Vec<f64> = raw
            .data()
            .iter()
            .enumerate()
            .map(|(k, &v)| v as f64 * w[k / HIDDEN] as f64)
            .collect();
        let mean1 = weighted.iter().sum::<f64>() / weighted.len() as f64;
        for (g, e) in got.data().iter().zip(&weighted) {
            let e = e * mean0 / mean1;
            assert!((*g as f64 - e).abs() < 1e-5, "chunk {c}: {g} vs {e}");
        }
        assert!((got.mean() as f64 - mean0).abs() < 1e-5);
    }
}

#[test]
fn cfg_pair_has_equal_lengths_and_stacks() {
    let tok = ClipTokenizer::sd1();
    let long: String = (0..80).map(|i| format!("w{i} ")).collect();
    let cfg = encode_cfg(&tok, &long, "blurry", infallible(toy)).expect("encode");
    assert_eq!(cfg.cond.shape(), cfg.uncond.shape());
    assert_eq!(cfg.cond.shape()[0] % CHUNK_LEN, 0);
    assert!(cfg.cond.shape()[0] >= 2 * CHUNK_LEN);
    // The negative prompt's extra chunk is the encoding of an empty chunk.
    let empty = toy(tok.tokenize("").tokens());
    let extra = cfg
        .uncond
        .slice(0, CHUNK_LEN, 2 * CHUNK_LEN)
        .expect("slice");
    assert_eq!(extra, empty);

    let s = cfg.stacked().expect("stack");
    assert_eq!(s.shape(), &[2, cfg.cond.shape()[0], HIDDEN]);
    assert_eq!(s.get(0).expect("uncond"), cfg.uncond);
    assert_eq!(s.get(1).expect("cond"), cfg.cond);
    let b = cfg.batched(3).expect("batch");
    assert_eq!(b.shape()[0], 6);
    assert_eq!(b.get(2).expect("uncond"), cfg.uncond);
    assert_eq!(b.get(3).expect("cond"), cfg.cond);
    assert_eq!(repeat_batch(&cfg.cond, 2).expect("repeat").shape()[0], 2);

    let other = Tensor::<f32>::zeros([CHUNK_LEN, HIDDEN]).expect("zeros");
    assert!(stack_uncond_cond(&other, &cfg.cond, 1).is_err());
}

#[test]
fn encoder_errors_and_bad_shapes() {
    let tok = ClipTokenizer::sd1();
    let err = encode_prompt(&tok, "a cat", |_: &[i32]| {
        Err::<Tensor<f32>, _>(std::io::Error::other("boom"))
    })
    .expect_err("fails");
    assert!(matches!(err, ConditioningError::Encoder { chunk: 0, .. }));
    assert!(err.to_string().contains("boom"));

    let err = encode_prompt(&tok, "a cat", |_: &[i32]| {
        Ok::<_, Infallible>(Tensor::<f32>::zeros([76, 4]).expect("zeros"))
    })
    .expect_err("bad shape");
    assert!(matches!(err, ConditioningError::EncoderShape { .. }));

    // [1, 77, hidden] is accepted.
    let ctx = encode_prompt(&tok, "a cat", |ids: &[i32]| {
        Ok::<_, Infallible>(toy(ids).unsqueeze(0).expect("unsqueeze"))
    })
    .expect("rank 3");
    assert_eq!(ctx.shape(), &[CHUNK_LEN, HIDDEN]);

    // Hidden size changing between chunks.
    let long: String = (0..80).map(|i| format!("w{i} ")).collect();
    let mut n = 0;
    let err = encode_prompt(&tok, &long, |_: &[i32]| {
        n += 1;
        Ok::<_, Infallible>(Tensor::<f32>::zeros([CHUNK_LEN, n]).expect("zeros"))
    })
    .expect_err("mismatch");
    assert!(matches!(err, ConditioningError::HiddenMismatch { .. }));
}
