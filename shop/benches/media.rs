//! The media derivation benchmark, run with `cargo bench --bench media`: derivations per second of a 12-megapixel
//! JPEG (4000 × 3000, generated here) on one core, and the process's peak resident memory while deriving.
//!
//! One derivation is what `media.process` does on its blocking thread for a new image: the checks up to the header
//! (`inspect`), then the bounded decode, the `large` (1600 px) and `thumb` (256 px) scale-downs and their JPEG
//! encodings (`derive`). It runs on this thread only, one after the other. Storage and PostgreSQL are not part of
//! it. The peak is `VmHWM`, reset (`/proc/self/clear_refs` = 5) after the source image was generated, so it counts
//! the derivations only (plus the process's baseline). Prints one JSON line.
//!
//! Environment: N derivations (default 20), after one warm-up.

use std::io::Cursor;
use std::time::Instant;

use conveyor_shop::domain::media::{ImageLimits, derive, inspect};
use image::{DynamicImage, ImageFormat, RgbImage};

/// A photo-like 4000 × 3000 picture: smooth gradients with a little deterministic noise (so that the JPEG is of a
/// realistic size, not a flat colour).
fn twelve_megapixels() -> Vec<u8> {
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let image = RgbImage::from_fn(4000, 3000, |x, y| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let noise = (seed % 24) as u32;
        image::Rgb([
            ((x / 16 + noise) % 256) as u8,
            ((y / 12 + noise) % 256) as u8,
            (((x + y) / 28 + noise) % 256) as u8,
        ])
    });
    let mut jpeg = Vec::new();
    DynamicImage::ImageRgb8(image).write_to(&mut Cursor::new(&mut jpeg), ImageFormat::Jpeg).unwrap();
    jpeg
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0)
}

fn main() {
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let jpeg = twelve_megapixels();
    // The defaults of CONVEYOR_MEDIA_MAX_BYTES and CONVEYOR_MEDIA_MAX_PIXELS.
    let limits = ImageLimits { max_bytes: 25 * 1024 * 1024, max_pixels: 64_000_000 };
    let peak_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let baseline_kib = status_kib("VmRSS:");

    let derive_once = || {
        let checked = inspect("image/jpeg", &jpeg, limits).expect("the generated JPEG passes the checks");
        let derived = derive(&jpeg, checked, limits).expect("the generated JPEG derives");
        assert_eq!(derived.images[0].width, 1600);
        derived.images.iter().map(|i| i.bytes.len()).sum::<usize>()
    };
    let derived_bytes = derive_once(); // warm-up
    let started = Instant::now();
    for _ in 0..n {
        std::hint::black_box(derive_once());
    }
    let elapsed = started.elapsed();
    let result = serde_json::json!({
        "scenario": "media-derive",
        "source": {"width": 4000, "height": 3000, "megapixels": 12, "jpeg_bytes": jpeg.len()},
        "derivations": n,
        "threads": 1,
        "seconds": elapsed.as_secs_f64(),
        "derivations_per_second": n as f64 / elapsed.as_secs_f64(),
        "ms_per_derivation": elapsed.as_secs_f64() * 1000.0 / n as f64,
        "derived_bytes": derived_bytes,
        "rss_baseline_mib": baseline_kib as f64 / 1024.0,
        "peak_rss_mib": status_kib("VmHWM:") as f64 / 1024.0,
        "peak_reset_after_generation": peak_reset,
    });
    println!("{result}");
}
