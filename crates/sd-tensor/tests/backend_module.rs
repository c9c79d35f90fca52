//! Loading ggml backend modules at run time: bad paths are errors naming the file, never a
//! crash, and leave the device list unchanged. (Loading a real module is driven on the GPU
//! machine by `scripts/device/cuda_run.sh`, which builds `libggml-cuda.so`.)

use sd_tensor::ggml::{Device, GgmlError};

fn device_names() -> Vec<String> {
    Device::all().iter().map(Device::name).collect()
}

#[test]
fn missing_and_non_library_modules_are_clear_errors() {
    let before = device_names();
    let missing = std::env::temp_dir().join("sd-rs-no-such-module/libggml-cuda.so");
    match Device::load_module(&missing) {
        Err(GgmlError::ModuleLoad { path, detail }) => {
            assert!(path.contains("sd-rs-no-such-module"), "{path}");
            assert!(detail.contains("no such file"), "{detail}");
        }
        other => panic!("expected a ModuleLoad error, got {other:?}"),
    }

    let dir = std::env::temp_dir().join(format!("sd-rs-module-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libggml-fake.so");
    std::fs::write(&fake, b"\x7fELF but not really a shared library").unwrap();
    let err = Device::load_module(&fake).unwrap_err();
    assert!(
        matches!(&err, GgmlError::ModuleLoad { path, .. } if path.contains("libggml-fake.so")),
        "{err:?}"
    );
    assert!(err.to_string().contains("libggml-fake.so"), "{err}");
    assert_eq!(device_names(), before);
    let _ = std::fs::remove_dir_all(&dir);
}
