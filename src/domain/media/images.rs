//! The checks and the derivation of one image, pure CPU work on bytes in memory (no I/O): run it on a blocking
//! thread.
//!
//! In order, cheapest first, and never allocating more than the limits allow:
//! 1. the magic number against the declared type ([`sniff`]): `UNSUPPORTED_TYPE`, `TYPE_MISMATCH`;
//! 2. the size: `TOO_LARGE`;
//! 3. the dimensions, read from the header only, against the pixel limit: `TOO_MANY_PIXELS` (a decompression bomb
//!    is refused here, before a byte of it is inflated);
//! 4. the decoding, under [`image::Limits`] (width, height and allocation bounded by the header's own numbers), so
//!    even a lying header never makes the decoder allocate more than the limits; a truncated or corrupt file is
//!    `CORRUPT`;
//! 5. the EXIF orientation applied to the pixels (so derivatives are upright), then re-encoding from pixels, which
//!    drops every metadata chunk or segment (EXIF, XMP, text, ICC): `thumb` (at most [`THUMB_PX`] on the longest
//!    side) and `large` (at most [`LARGE_PX`]), never upscaled. The dimensions reported are the upright ones.

use std::io::Cursor;

use bytes::Bytes;
use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageError, ImageFormat, ImageReader};

/// Longest side of `thumb`.
pub const THUMB_PX: u32 = 256;
/// Longest side of `large`.
pub const LARGE_PX: u32 = 1600;
/// JPEG quality of the derivatives.
pub const JPEG_QUALITY: u8 = 85;

/// The rejection codes of the contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectionCode {
    /// The declared type, or the format the bytes are in, is not one Conveyor derives.
    UnsupportedType,
    /// The bytes are not of the declared type.
    TypeMismatch,
    /// More bytes than `CONVEYOR_MEDIA_MAX_BYTES`.
    TooLarge,
    /// More pixels than `CONVEYOR_MEDIA_MAX_PIXELS`.
    TooManyPixels,
    /// Truncated or corrupt.
    Corrupt,
}

impl RejectionCode {
    /// The code as clients see it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnsupportedType => "UNSUPPORTED_TYPE",
            Self::TypeMismatch => "TYPE_MISMATCH",
            Self::TooLarge => "TOO_LARGE",
            Self::TooManyPixels => "TOO_MANY_PIXELS",
            Self::Corrupt => "CORRUPT",
        }
    }
}

/// A refusal: its code and a text for the client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", code.as_str())]
pub struct Refusal {
    /// The code.
    pub code: RejectionCode,
    /// Text for the client.
    pub detail: String,
}

fn refuse(code: RejectionCode, detail: impl Into<String>) -> Refusal {
    Refusal { code, detail: detail.into() }
}

/// The limits of `CONVEYOR_MEDIA_MAX_BYTES` and `CONVEYOR_MEDIA_MAX_PIXELS`.
#[derive(Clone, Copy, Debug)]
pub struct ImageLimits {
    /// Largest original, in bytes.
    pub max_bytes: u64,
    /// Largest width × height.
    pub max_pixels: u64,
}

impl ImageLimits {
    /// The most one decode may allocate for its pixels: `max_pixels` at 8 bytes a pixel (16-bit RGBA, the widest
    /// layout PNG and JPEG decode to).
    pub fn max_decode_alloc(&self) -> u64 {
        self.max_pixels.saturating_mul(8)
    }
}

/// An image format Conveyor derives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// PNG.
    Png,
    /// JPEG.
    Jpeg,
}

impl Format {
    /// Its content type.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
        }
    }

    /// The format of a declared content type, if supported.
    pub fn from_content_type(content_type: &str) -> Option<Self> {
        match content_type {
            "image/png" => Some(Self::Png),
            "image/jpeg" => Some(Self::Jpeg),
            _ => None,
        }
    }

    fn image_format(self) -> ImageFormat {
        match self {
            Self::Png => ImageFormat::Png,
            Self::Jpeg => ImageFormat::Jpeg,
        }
    }
}

/// What the magic number says the bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// A supported format.
    Supported(Format),
    /// A recognized image format Conveyor does not derive (GIF, WebP, TIFF, ...), by name.
    Unsupported(&'static str),
    /// Nothing recognizable.
    Unknown,
}

/// Reads the magic number.
pub fn sniff(bytes: &[u8]) -> Sniffed {
    const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";
    if bytes.starts_with(PNG) {
        return Sniffed::Supported(Format::Png);
    }
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        return Sniffed::Supported(Format::Jpeg);
    }
    let others: &[(&[u8], &'static str)] = &[
        (b"GIF87a", "GIF"),
        (b"GIF89a", "GIF"),
        (b"BM", "BMP"),
        (b"II*\0", "TIFF"),
        (b"MM\0*", "TIFF"),
        (b"\0\0\x01\0", "ICO"),
        (b"8BPS", "PSD"),
        (b"\xff\x0a", "JPEG XL"),
        (b"%PDF", "PDF"),
    ];
    if let Some((_, name)) = others.iter().find(|(magic, _)| bytes.starts_with(magic)) {
        return Sniffed::Unsupported(name);
    }
    if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        return Sniffed::Unsupported("WebP");
    }
    if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        return Sniffed::Unsupported("HEIF/AVIF");
    }
    Sniffed::Unknown
}

/// An image that passed the checks up to its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    /// Its format (the declared one, confirmed by the magic number).
    pub format: Format,
    /// Pixels, from the header.
    pub width: u32,
    /// Pixels, from the header.
    pub height: u32,
}

/// Steps 1 to 3: type, size and the header's dimensions, without decoding a pixel.
pub fn inspect(declared: &str, bytes: &[u8], limits: ImageLimits) -> Result<Checked, Refusal> {
    let Some(format) = Format::from_content_type(declared) else {
        return Err(refuse(RejectionCode::UnsupportedType, format!("`{declared}` is not a supported content type")));
    };
    match sniff(bytes) {
        Sniffed::Supported(found) if found == format => {}
        Sniffed::Supported(found) => {
            return Err(refuse(
                RejectionCode::TypeMismatch,
                format!("declared {declared} but the bytes are {}", found.content_type()),
            ));
        }
        Sniffed::Unsupported(name) => {
            return Err(refuse(
                RejectionCode::UnsupportedType,
                format!("the bytes are {name}, which is not supported"),
            ));
        }
        Sniffed::Unknown => {
            return Err(refuse(RejectionCode::TypeMismatch, format!("the bytes are not {declared}")));
        }
    }
    if bytes.len() as u64 > limits.max_bytes {
        return Err(refuse(RejectionCode::TooLarge, format!("larger than {} bytes", limits.max_bytes)));
    }
    let (width, height) = ImageReader::with_format(Cursor::new(bytes), format.image_format())
        .into_dimensions()
        .map_err(|e| refuse(RejectionCode::Corrupt, format!("unreadable header: {}", short(&e))))?;
    if width == 0 || height == 0 {
        return Err(refuse(RejectionCode::Corrupt, "the header declares an empty image"));
    }
    check_pixels(width, height, limits)?;
    Ok(Checked { format, width, height })
}

/// The pixel limit, for dimensions read from a header or a stored derivation.
pub fn check_pixels(width: u32, height: u32, limits: ImageLimits) -> Result<(), Refusal> {
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_pixels {
        return Err(refuse(
            RejectionCode::TooManyPixels,
            format!("{width}x{height} is {pixels} pixels, more than the limit of {}", limits.max_pixels),
        ));
    }
    Ok(())
}

/// One derived image, encoded.
#[derive(Clone, Debug)]
pub struct DerivedImage {
    /// `thumb` or `large`.
    pub name: &'static str,
    /// Pixels.
    pub width: u32,
    /// Pixels.
    pub height: u32,
    /// The content type of `bytes` (the original's format).
    pub content_type: &'static str,
    /// The encoded image, without metadata.
    pub bytes: Bytes,
}

/// The derivatives of one image.
#[derive(Clone, Debug)]
pub struct Derived {
    /// The original's dimensions.
    pub width: u32,
    /// The original's dimensions.
    pub height: u32,
    /// `large`, then `thumb`.
    pub images: Vec<DerivedImage>,
}

/// Steps 4 and 5: decodes an [`inspect`]ed image under limits and derives `large` and `thumb` from its pixels.
pub fn derive(bytes: &[u8], checked: Checked, limits: ImageLimits) -> Result<Derived, Refusal> {
    if checked.format == Format::Jpeg && !jpeg_is_complete(bytes) {
        return Err(refuse(RejectionCode::Corrupt, "the JPEG is truncated (no end of image after its scan)"));
    }
    let mut reader = ImageReader::with_format(Cursor::new(bytes), checked.format.image_format());
    let mut decode_limits = image::Limits::default();
    decode_limits.max_image_width = Some(checked.width);
    decode_limits.max_image_height = Some(checked.height);
    decode_limits.max_alloc = Some(limits.max_decode_alloc());
    reader.limits(decode_limits);
    let refusal = |e: ImageError| match e {
        ImageError::Limits(_) => refuse(RejectionCode::TooManyPixels, format!("decoding refused: {}", short(&e))),
        other => refuse(RejectionCode::Corrupt, format!("undecodable: {}", short(&other))),
    };
    let mut decoder = reader.into_decoder().map_err(refusal)?;
    // The EXIF orientation (a camera held sideways): applied to the pixels, since re-encoding drops the tag. An
    // unreadable EXIF block leaves the image as stored.
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let decoded = DynamicImage::from_decoder(decoder).map_err(refusal)?;
    // Test hook: the original and its decoded pixels are in memory here.
    fail::fail_point!("media::decoded");
    // Turned after the conversion to 8 bits (the decoded buffer is gone by then), so the copy a rotation makes is of
    // the smaller layout: at most 4 + 4 bytes a pixel at once, within the 12 of the memory bound.
    let mut pixels = eight_bit(decoded, checked.format);
    pixels.apply_orientation(orientation);
    let (width, height) = (pixels.width(), pixels.height());
    let large = fit(pixels, LARGE_PX);
    let thumb = fit(large.clone(), THUMB_PX);
    let images = vec![encode("large", &large, checked.format)?, encode("thumb", &thumb, checked.format)?];
    Ok(Derived { width, height, images })
}

/// The pixels in a layout the format's encoder takes: 8 bits a channel; for JPEG no alpha.
fn eight_bit(image: DynamicImage, format: Format) -> DynamicImage {
    let gray = !image.color().has_color();
    let alpha = image.color().has_alpha();
    match (format, gray, alpha) {
        (_, true, false) if matches!(image, DynamicImage::ImageLuma8(_)) => image,
        (_, true, false) => DynamicImage::ImageLuma8(image.to_luma8()),
        (Format::Jpeg, true, true) => DynamicImage::ImageLuma8(image.to_luma8()),
        (Format::Jpeg, false, _) if matches!(image, DynamicImage::ImageRgb8(_)) => image,
        (Format::Jpeg, false, _) => DynamicImage::ImageRgb8(image.to_rgb8()),
        (Format::Png, true, true) if matches!(image, DynamicImage::ImageLumaA8(_)) => image,
        (Format::Png, true, true) => DynamicImage::ImageLumaA8(image.to_luma_alpha8()),
        (Format::Png, false, false) if matches!(image, DynamicImage::ImageRgb8(_)) => image,
        (Format::Png, false, false) => DynamicImage::ImageRgb8(image.to_rgb8()),
        (Format::Png, false, true) if matches!(image, DynamicImage::ImageRgba8(_)) => image,
        (Format::Png, false, true) => DynamicImage::ImageRgba8(image.to_rgba8()),
    }
}

/// Scales down to at most `longest` pixels on the longest side, keeping the aspect ratio; never up.
fn fit(image: DynamicImage, longest: u32) -> DynamicImage {
    if image.width().max(image.height()) <= longest {
        return image;
    }
    image.thumbnail(longest, longest)
}

fn encode(name: &'static str, image: &DynamicImage, format: Format) -> Result<DerivedImage, Refusal> {
    let mut out = Vec::new();
    let encoded = match format {
        Format::Jpeg => {
            image.write_with_encoder(image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, JPEG_QUALITY))
        }
        Format::Png => image.write_with_encoder(image::codecs::png::PngEncoder::new(&mut out)),
    };
    // The pixels were converted to a layout the encoder takes; a failure here is a bug, reported as corrupt input
    // rather than retried forever.
    encoded.map_err(|e| refuse(RejectionCode::Corrupt, format!("cannot encode: {}", short(&e))))?;
    Ok(DerivedImage {
        name,
        width: image.width(),
        height: image.height(),
        content_type: format.content_type(),
        bytes: Bytes::from(out),
    })
}

/// Whether a JPEG has an end-of-image marker after its first scan. The decoder fills a truncated scan with grey
/// rather than failing; a file cut short has no `FF D9` after its first `FF DA` (inside entropy-coded data a `FF` is
/// always followed by `00` or a restart marker).
fn jpeg_is_complete(bytes: &[u8]) -> bool {
    let mut at = 2; // after SOI
    // Walk the marker segments up to the first start of scan.
    loop {
        while at < bytes.len() && bytes[at] == 0xFF && bytes.get(at + 1) == Some(&0xFF) {
            at += 1; // fill bytes
        }
        if at + 4 > bytes.len() || bytes[at] != 0xFF {
            return false;
        }
        let marker = bytes[at + 1];
        let length = usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
        if marker == 0xDA {
            let scan = at + 2 + length;
            return scan <= bytes.len() && bytes[scan..].windows(2).any(|w| w == [0xFF, 0xD9]);
        }
        at += 2 + length;
    }
}

/// An image error's text, bounded (it is shown to the client).
fn short(e: &ImageError) -> String {
    let mut text = e.to_string();
    if text.len() > 200 {
        let cut = (0..=200).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ImageLimits = ImageLimits { max_bytes: 1 << 20, max_pixels: 1_000_000 };

    fn png(width: u32, height: u32) -> Vec<u8> {
        let image = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Vec::new();
        DynamicImage::ImageRgb8(image).write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    fn jpeg(width: u32, height: u32) -> Vec<u8> {
        let image = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Vec::new();
        DynamicImage::ImageRgb8(image).write_to(&mut Cursor::new(&mut out), ImageFormat::Jpeg).unwrap();
        out
    }

    #[test]
    fn magic_numbers_decide_the_type() {
        assert_eq!(sniff(&png(2, 2)), Sniffed::Supported(Format::Png));
        assert_eq!(sniff(&jpeg(2, 2)), Sniffed::Supported(Format::Jpeg));
        assert_eq!(sniff(b"GIF89a...."), Sniffed::Unsupported("GIF"));
        assert_eq!(sniff(b"hello"), Sniffed::Unknown);
        let code = |declared: &str, bytes: &[u8]| inspect(declared, bytes, LIMITS).unwrap_err().code;
        assert_eq!(code("image/png", &jpeg(2, 2)), RejectionCode::TypeMismatch);
        assert_eq!(code("image/png", b"not an image at all"), RejectionCode::TypeMismatch);
        assert_eq!(code("image/png", b"GIF89a\x01\x00\x01\x00"), RejectionCode::UnsupportedType);
        assert_eq!(code("image/gif", &png(2, 2)), RejectionCode::UnsupportedType);
    }

    #[test]
    fn large_and_thumb_fit_their_bounds_and_are_never_upscaled() {
        let bytes = png(2000, 1000);
        let checked = inspect("image/png", &bytes, ImageLimits { max_pixels: 4_000_000, ..LIMITS }).unwrap();
        assert_eq!((checked.width, checked.height), (2000, 1000));
        let derived = derive(&bytes, checked, ImageLimits { max_pixels: 4_000_000, ..LIMITS }).unwrap();
        let sizes: Vec<_> = derived.images.iter().map(|i| (i.name, i.width, i.height)).collect();
        assert_eq!(sizes, [("large", 1600, 800), ("thumb", 256, 128)]);

        let small = jpeg(100, 50);
        let derived = derive(&small, inspect("image/jpeg", &small, LIMITS).unwrap(), LIMITS).unwrap();
        let sizes: Vec<_> = derived.images.iter().map(|i| (i.name, i.width, i.height)).collect();
        assert_eq!(sizes, [("large", 100, 50), ("thumb", 100, 50)]);
    }

    #[test]
    fn truncated_files_are_corrupt() {
        let bytes = png(300, 300);
        let cut = &bytes[..bytes.len() / 2];
        let checked = inspect("image/png", cut, LIMITS).unwrap();
        assert_eq!(derive(cut, checked, LIMITS).unwrap_err().code, RejectionCode::Corrupt);
        let bytes = jpeg(300, 300);
        let cut = &bytes[..bytes.len() / 2];
        let checked = inspect("image/jpeg", cut, LIMITS).unwrap();
        assert_eq!(derive(cut, checked, LIMITS).unwrap_err().code, RejectionCode::Corrupt);
        assert!(jpeg_is_complete(&bytes));
    }

    #[test]
    fn too_many_pixels_are_refused_from_the_header() {
        let bytes = png(1001, 1000);
        assert_eq!(inspect("image/png", &bytes, LIMITS).unwrap_err().code, RejectionCode::TooManyPixels);
        assert_eq!(
            inspect("image/png", &bytes, ImageLimits { max_bytes: 10, ..LIMITS }).unwrap_err().code,
            RejectionCode::TooLarge
        );
    }
}
