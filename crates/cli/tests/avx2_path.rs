//! `train.simd = "avx2"` (`SPARROW_SIMD=avx2`): Sparrow's kernels as on a
//! CPU with AVX2 and FMA but no AVX-512 (an AMD Zen 3), the narrow fp32
//! product's included. Each kernel's AVX2 build sums as its AVX-512 build
//! does, so it trains the same model to the byte as `auto`: the
//! multi-task kinds, DIN with its batch norm, and the MLP with bf16
//! embedding rows. (bf16 products are other bits by design where the CPU
//! has AVX-512-BF16: `avx2` takes them to the fp32 kernels on rounded
//! inputs, as on such a CPU, to the same accuracy, and says why.) `avx2`
//! is seen to take hold: the run says so, and `sparrow bench` names the
//! AVX2 narrow kernel and measures the fp32 ceiling on 256-bit FMAs, with
//! no bf16 or AMX ceiling; the `gemm` crate's own kernels, which it does
//! not reach (products wider than 64 columns), are named as they are.

mod common;

use std::path::Path;

use common::{last_json, sparrow};

fn cpu_has(flag: &str) -> bool {
    std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|f| f == flag))
}

/// `sparrow train` on the behaviour config in `dir` with `sets`, under
/// `SPARROW_SIMD=simd`: its summary, its stderr and its checkpoint.
fn train(dir: &Path, simd: &str, name: &str, sets: &[&str]) -> (serde_json::Value, String, std::path::PathBuf) {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/behaviour-tasks.toml");
    let mut cmd = sparrow();
    cmd.current_dir(dir).env("SPARROW_SIMD", simd).args(["train", "--config", config]);
    cmd.args(["--set", "train.epochs=1", "--set", &format!("checkpoint.dir=\"ck/{name}-{simd}\"")]);
    for set in sets {
        cmd.args(["--set", set]);
    }
    let out = cmd.output().expect("train");
    assert!(out.status.success(), "{name} {simd}: {}", String::from_utf8_lossy(&out.stderr));
    let summary = last_json(&out);
    let ckpt = dir.join(summary["checkpoint"].as_str().expect("checkpoint"));
    (summary, String::from_utf8_lossy(&out.stderr).to_string(), ckpt)
}

#[test]
fn avx2_kernels_train_the_same_model_bit_for_bit() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("data/behaviour").display().to_string();
    let out = sparrow()
        .args(["gen", "--out", &data, "--train-rows", "4000", "--test-rows", "1000"])
        .args(["--tasks", "--sequence", "--classes", "4"])
        .output()
        .expect("gen");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let modes: [(&str, &[&str]); 5] = [
        ("ple", &["model.kind=\"ple\""]),
        ("mmoe", &["model.kind=\"mmoe\""]),
        // ESMM: the click and the conversion, no class task.
        (
            "esmm",
            &[
                "model.kind=\"esmm\"",
                "data.schema.labels=[\"click\", \"conversion\"]",
                "model.tasks=[{name=\"click\"}, {name=\"conversion\"}]",
            ],
        ),
        ("din", &["model.kind=\"din\""]),
        ("mlp-bf16-rows", &["embedding.dtype=\"bf16\""]),
    ];
    for (name, sets) in modes {
        let (auto, _, auto_ck) = train(tmp.path(), "auto", name, sets);
        let (avx2, said, avx2_ck) = train(tmp.path(), "avx2", name, sets);
        assert!(said.contains("train.simd = \"avx2\": Sparrow's kernels run as on a CPU without AVX-512"), "{said}");
        for key in ["test_auc", "test_logloss", "train_logloss"] {
            assert_eq!(auto[key].as_f64(), avx2[key].as_f64(), "{name}: {key}");
        }
        for file in ["embeddings.bin", "dense.safetensors"] {
            let (a, b) = (std::fs::read(auto_ck.join(file)), std::fs::read(avx2_ck.join(file)));
            assert!(a.expect(file) == b.expect(file), "{name}: {file} differs between avx2 and auto");
        }
    }
    // bf16 products: on AVX-512-BF16 `vdpbf16ps` natively, the fp32 kernels
    // on rounded inputs under `avx2` (other bits, the same accuracy).
    let bf16 = ["model.kind=\"mmoe\"", "model.precision=\"bf16\""];
    let (auto, _, _) = train(tmp.path(), "auto", "bf16", &bf16);
    let (avx2, said, _) = train(tmp.path(), "avx2", "bf16", &bf16);
    assert!(said.contains("train.simd = \"avx2\" keeps it out") && said.contains("bf16-rounded inputs"), "{said}");
    let auc = |j: &serde_json::Value| j["test_auc"].as_f64().expect("auc");
    assert!((auc(&auto) - auc(&avx2)).abs() < 0.01, "bf16: {auto} against {avx2}");

    let out = sparrow()
        .env("SPARROW_SIMD", "avx2")
        .args(["bench", "--dims", "8", "--table-rows", "1000", "--batches", "1", "--threads", "1"])
        .args(["--dtypes", "f32", "--optimizers", "adagrad", "--train-steps", "0", "--kind-steps", "0"])
        .args(["--memory-rows", "0", "--gather-limit", "/nonexistent/gather-limit.c"])
        .output()
        .expect("bench");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bench = last_json(&out);
    assert_eq!(bench["simd"], "avx2", "{bench}");
    assert_ne!(bench["precision_paths"]["f32_narrow"], "avx512", "{bench}");
    assert_ne!(bench["precision_paths"]["bf16"], "avx512_bf16", "{bench}");
    let peaks = &bench["arithmetic"]["peaks"];
    assert!(peaks["bf16_dot"].is_null() && peaks["amx_bf16"].is_null(), "{bench}");
    assert!(!bench["arithmetic"]["peaks"]["fp32_fma"]["kernel"].as_str().expect("kernel").contains("avx512"));
    if cpu_has("avx2") && cpu_has("fma") {
        assert_eq!(bench["precision_paths"]["f32_narrow"], "avx2", "{bench}");
    }
    // `gemm`'s own kernels are out of its reach, and named as they are.
    let gemm = if cpu_has("avx512f") {
        "avx512f"
    } else if cpu_has("avx2") && cpu_has("fma") {
        "avx2_fma"
    } else {
        "baseline"
    };
    assert_eq!(bench["precision_paths"]["f32_gemm"], gemm, "{bench}");
}
