//! The checks and the derivation of one image, pure CPU work on bytes in memory (no I/O): run it on a blocking
//! thread.
//!
//! In order, cheapest first, and never allocating more than the limits allow:
//! 1. the magic number against the declared type ([`sniff`]): `UNSUPPORTED_TYPE`, `TYPE_MISMATCH`;
//! 2. the size: `TOO_LARGE`;
//! 3. the dimensions, read from the header only, against the pixel limit: `TOO_MANY_PIXELS` (a decompression bomb
//!    is refused here, before a byte of it is inflated);
//! 4. the memory decoding it takes, also from the header ([`Checked::memory`]: the original, the pixels at 8 bits a
//!    sample, the decoder's working memory and the derivatives), which the caller reserves from the worker's decode
//!    memory before decoding, or refuses (`TOO_MANY_PIXELS`) when it is more than all of it;
//! 5. the decoding, under the decoders' own limits as a backstop; a PNG of 16 bits a sample is brought to 8 bits row
//!    by row as it is inflated (the 16-bit image never exists whole), a JPEG decodes to 8 bits; a truncated or
//!    corrupt file is `CORRUPT`;
//! 6. `large` (at most [`LARGE_PX`] on the longest side) and `thumb` (at most [`THUMB_PX`]), never upscaled, then the
//!    EXIF orientation applied to them (so derivatives are upright; turning the derivatives rather than the original
//!    copies a few megabytes, not the whole image), then re-encoding from pixels, which drops every metadata chunk or
//!    segment (EXIF, XMP, text, ICC). The dimensions reported are the upright ones.

use std::io::Cursor;

use bytes::Bytes;
use image::metadata::Orientation;
use image::{DynamicImage, ImageBuffer, ImageDecoder, ImageError, ImageFormat, ImageReader};

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
    /// More pixels than `CONVEYOR_MEDIA_MAX_PIXELS`, or more than `CONVEYOR_MEDIA_DECODE_MEMORY` holds decoded.
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
    /// The most bytes deriving it holds at once, from its header: the original, the decoder's copy of it (JPEG) and
    /// working memory, the pixels at 8 bits a sample (plus a conversion copy where the decoded layout is not one the
    /// encoder takes) and the derivatives. What the caller reserves before [`derive`].
    pub memory: u64,
    /// The layout the header declares, for messages (`16-bit RGBA`, `8-bit YCbCr, progressive`).
    pub layout: &'static str,
}

/// Working memory of the PNG decoder while inspecting a header (ancillary chunks before the image data).
const PNG_HEADER_ALLOC: usize = 8 * 1024 * 1024;

/// Steps 1 to 4: type, size, the header's dimensions and the memory decoding takes, without decoding a pixel.
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
    match format {
        Format::Png => inspect_png(bytes, limits),
        Format::Jpeg => inspect_jpeg(bytes, limits),
    }
}

fn unreadable(what: impl std::fmt::Display) -> Refusal {
    refuse(RejectionCode::Corrupt, format!("unreadable header: {}", bounded(what.to_string())))
}

fn empty_or_too_many(width: u32, height: u32, limits: ImageLimits) -> Result<(), Refusal> {
    if width == 0 || height == 0 {
        return Err(refuse(RejectionCode::Corrupt, "the header declares an empty image"));
    }
    check_pixels(width, height, limits)
}

/// The most bytes the derivatives of a `width` × `height` image of `channels` 8-bit samples hold at once: `large`
/// (at most the image's own size, capped at [`LARGE_PX`] a side), a copy of it (the source of `thumb`, or the turn of
/// an EXIF orientation) and its encoding, plus a mebibyte for `thumb` and the encoders.
fn derivatives_memory(width: u32, height: u32, channels: u64) -> u64 {
    let large = u64::from(width.min(LARGE_PX)) * u64::from(height.min(LARGE_PX)) * channels;
    3 * large + (1 << 20)
}

fn png_decoder(bytes: &[u8], alloc: usize) -> png::Decoder<Cursor<&[u8]>> {
    let mut decoder = png::Decoder::new_with_limits(Cursor::new(bytes), png::Limits { bytes: alloc });
    // EXPAND: palettes, low bit depths and tRNS to 8-bit samples; STRIP_16: 16-bit samples to 8 as each row is
    // unfiltered, so the output buffer is the 8-bit image and the 16-bit one never exists whole.
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    // Metadata is dropped by re-encoding anyway: never inflate text or ICC chunks.
    decoder.set_ignore_text_chunk(true);
    decoder.set_ignore_iccp_chunk(true);
    decoder
}

fn inspect_png(bytes: &[u8], limits: ImageLimits) -> Result<Checked, Refusal> {
    let mut decoder = png_decoder(bytes, PNG_HEADER_ALLOC);
    let header = decoder.read_header_info().map_err(unreadable)?;
    let (width, height) = (header.width, header.height);
    empty_or_too_many(width, height, limits)?;
    let layout = match (header.color_type, header.bit_depth) {
        (png::ColorType::Rgba, png::BitDepth::Sixteen) => "16-bit RGBA",
        (png::ColorType::Rgb, png::BitDepth::Sixteen) => "16-bit RGB",
        (png::ColorType::GrayscaleAlpha, png::BitDepth::Sixteen) => "16-bit grey and alpha",
        (png::ColorType::Grayscale, png::BitDepth::Sixteen) => "16-bit grey",
        (png::ColorType::Rgba, _) => "8-bit RGBA",
        (png::ColorType::Rgb, _) => "8-bit RGB",
        (png::ColorType::Indexed, _) => "indexed colour",
        (png::ColorType::GrayscaleAlpha, _) => "8-bit grey and alpha",
        (png::ColorType::Grayscale, _) => "grey",
    };
    // Up to the first image data: a tRNS chunk makes the 8-bit output gain an alpha channel.
    let reader = decoder.read_info().map_err(unreadable)?;
    let too_many =
        || refuse(RejectionCode::TooManyPixels, format!("{width}x{height} {layout} cannot be held in memory"));
    let pixels = reader.output_buffer_size().ok_or_else(too_many)? as u64;
    let channels = reader.output_color_type().0.samples() as u64;
    // The decoder's own: the rows it inflates and unfilters (a few at a time, in the widest layout, 16 bits a sample)
    // and the inflater's window.
    let working = 16 * reader.info().raw_row_length() as u64 + (1 << 20);
    let memory = bytes.len() as u64 + working + pixels + derivatives_memory(width, height, channels);
    Ok(Checked { format: Format::Png, width, height, memory, layout })
}

/// What a JPEG's frame header (SOFn) and first scan header (SOS) say.
#[derive(Clone, Debug, PartialEq, Eq)]
struct JpegFrame {
    /// The SOF marker's last byte: 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    sof: u8,
    width: u32,
    height: u32,
    /// (horizontal, vertical) sampling factors of each component.
    sampling: Vec<(u8, u8)>,
    /// Components in the first scan: fewer than the frame's means several scans, buffered whole.
    first_scan: u8,
}

/// Walks the marker segments up to the first start of scan, reading the frame header on the way; `None` when either
/// is missing or malformed. Bytes between segments that are not a marker are skipped, as decoders do.
fn jpeg_frame(bytes: &[u8]) -> Option<JpegFrame> {
    let mut at = 2; // after SOI
    let mut frame: Option<JpegFrame> = None;
    loop {
        while at < bytes.len() && bytes[at] != 0xFF {
            at += 1;
        }
        while at + 1 < bytes.len() && bytes[at + 1] == 0xFF {
            at += 1; // fill bytes
        }
        if at + 4 > bytes.len() {
            return None;
        }
        let marker = bytes[at + 1];
        if marker == 0x01 || (0xD0..=0xD7).contains(&marker) {
            at += 2; // standalone markers
            continue;
        }
        if marker == 0xD9 {
            return None; // EOI before a scan
        }
        let length = usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
        let segment = bytes.get(at + 4..at + 2 + length)?;
        match marker {
            0xC0..=0xCF if ![0xC4, 0xC8, 0xCC].contains(&marker) => {
                let (&count, rest) = segment.get(5..)?.split_first()?;
                let components = rest.get(..3 * usize::from(count))?;
                let sampling: Vec<(u8, u8)> = components.chunks(3).map(|c| (c[1] >> 4, c[1] & 0x0F)).collect();
                if count == 0 || sampling.iter().any(|&(h, v)| !(1..=4).contains(&h) || !(1..=4).contains(&v)) {
                    return None;
                }
                frame = Some(JpegFrame {
                    sof: marker,
                    height: u32::from(u16::from_be_bytes([segment[1], segment[2]])),
                    width: u32::from(u16::from_be_bytes([segment[3], segment[4]])),
                    sampling,
                    first_scan: 0,
                });
            }
            0xDA => {
                let mut frame = frame?;
                frame.first_scan = *segment.first()?;
                return Some(frame);
            }
            _ => {}
        }
        at += 2 + length;
    }
}

fn inspect_jpeg(bytes: &[u8], limits: ImageLimits) -> Result<Checked, Refusal> {
    let frame = jpeg_frame(bytes).ok_or_else(|| unreadable("no frame and scan header"))?;
    let (width, height) = (frame.width, frame.height);
    empty_or_too_many(width, height, limits)?;
    let (w, h) = (u64::from(width), u64::from(height));
    let components = frame.sampling.len() as u64;
    let progressive = matches!(frame.sof, 0xC2 | 0xC6 | 0xCA | 0xCE);
    let layout = match (components, progressive) {
        (1, false) => "8-bit grey",
        (1, true) => "8-bit grey, progressive",
        (3, false) => "8-bit YCbCr",
        (3, true) => "8-bit YCbCr, progressive",
        (4, false) => "8-bit CMYK",
        (4, true) => "8-bit CMYK, progressive",
        (_, false) => "8-bit",
        (_, true) => "8-bit, progressive",
    };
    // The decoder's output, 8 bits a sample: grey, or RGB (YCbCr and CMYK are converted as they are decoded);
    // anything else is taken as four channels and converted once more for the encoder.
    let (decoded, converted) = match components {
        1 => (1, 0),
        3 | 4 => (3, 0),
        _ => (4, 3),
    };
    let pixels = w * h * (decoded + converted);
    // A progressive image, or one whose components come in several scans, is buffered whole as coefficients (two
    // bytes each, per component at its own sampling, padded to whole blocks) before a pixel is produced.
    let (h_max, v_max) = frame.sampling.iter().fold((1, 1), |(a, b), &(h, v)| (a.max(h), b.max(v)));
    let (blocks_x, blocks_y) = (w.div_ceil(8 * u64::from(h_max)), h.div_ceil(8 * u64::from(v_max)));
    let coefficients = if progressive || u64::from(frame.first_scan) < components {
        frame.sampling.iter().map(|&(hs, vs)| blocks_x * blocks_y * 64 * u64::from(hs) * u64::from(vs) * 2).sum()
    } else {
        0
    };
    // The decoder's rows (coefficients, upsampling and colour conversion of one row of blocks per component) and
    // its copy of the whole file (the image crate's decoder reads it into a buffer of its own).
    let working = 320 * w.next_multiple_of(16) * components + (1 << 20) + bytes.len() as u64;
    let memory = bytes.len() as u64 + working + coefficients + pixels + derivatives_memory(width, height, 3);
    Ok(Checked { format: Format::Jpeg, width, height, memory, layout })
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

/// The decode memory: an image whose [`Checked::memory`] is more than all of `decode_memory` (the worker's
/// `CONVEYOR_MEDIA_DECODE_MEMORY`) is refused without decoding.
pub(crate) fn check_memory(checked: &Checked, decode_memory: u64) -> Result<(), Refusal> {
    if checked.memory > decode_memory {
        let mib = |n: u64| n.div_ceil(1 << 20);
        return Err(refuse(
            RejectionCode::TooManyPixels,
            format!(
                "{}x{} {} needs {} MiB to decode, more than the decode memory of {} MiB",
                checked.width,
                checked.height,
                checked.layout,
                mib(checked.memory),
                mib(decode_memory)
            ),
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

/// Steps 5 and 6: decodes an [`inspect`]ed image, within what it reserved ([`Checked::memory`]), and derives `large`
/// and `thumb` from its pixels.
pub fn derive(bytes: &[u8], checked: Checked, limits: ImageLimits) -> Result<Derived, Refusal> {
    check_pixels(checked.width, checked.height, limits)?;
    let (pixels, orientation) = match checked.format {
        Format::Png => decode_png(bytes, &checked)?,
        Format::Jpeg => decode_jpeg(bytes, &checked)?,
    };
    // Test hook: the original and its decoded pixels are in memory here.
    fail::fail_point!("media::decoded");
    let (stored_width, stored_height) = (pixels.width(), pixels.height());
    // Scaled down first, turned after: the copy a rotation makes is of `large`, not of the whole image.
    let mut large = fit(pixels, LARGE_PX);
    large.apply_orientation(orientation);
    let thumb = fit(large.clone(), THUMB_PX);
    let turned = matches!(
        orientation,
        Orientation::Rotate90 | Orientation::Rotate270 | Orientation::Rotate90FlipH | Orientation::Rotate270FlipH
    );
    let (width, height) = if turned { (stored_height, stored_width) } else { (stored_width, stored_height) };
    let images = vec![encode("large", &large, checked.format)?, encode("thumb", &thumb, checked.format)?];
    Ok(Derived { width, height, images })
}

fn png_refusal(e: png::DecodingError) -> Refusal {
    match e {
        png::DecodingError::LimitsExceeded => refuse(RejectionCode::TooManyPixels, "decoding refused: memory limit"),
        other => refuse(RejectionCode::Corrupt, format!("undecodable: {}", bounded(other.to_string()))),
    }
}

/// Decodes a PNG straight to 8 bits a sample, in the layout the PNG encoder takes (grey, grey and alpha, RGB, RGBA),
/// within the memory its inspection counted.
fn decode_png(bytes: &[u8], checked: &Checked) -> Result<(DynamicImage, Orientation), Refusal> {
    let alloc = usize::try_from(checked.memory).unwrap_or(usize::MAX);
    let mut reader = png_decoder(bytes, alloc).read_info().map_err(png_refusal)?;
    let orientation = reader
        .info()
        .exif_metadata
        .as_deref()
        .and_then(Orientation::from_exif_chunk)
        .unwrap_or(Orientation::NoTransforms);
    let size = reader.output_buffer_size().ok_or(png::DecodingError::LimitsExceeded).map_err(png_refusal)?;
    let mut buffer = vec![0u8; size];
    let frame = reader.next_frame(&mut buffer).map_err(png_refusal)?;
    if (frame.width, frame.height) != (checked.width, checked.height) || frame.bit_depth != png::BitDepth::Eight {
        return Err(refuse(RejectionCode::Corrupt, "undecodable: the image data does not match its header"));
    }
    buffer.truncate(frame.buffer_size());
    let (width, height) = (frame.width, frame.height);
    let mismatch = || refuse(RejectionCode::Corrupt, "undecodable: the image data does not match its header");
    let image = match frame.color_type {
        png::ColorType::Grayscale => {
            DynamicImage::ImageLuma8(ImageBuffer::from_raw(width, height, buffer).ok_or_else(mismatch)?)
        }
        png::ColorType::GrayscaleAlpha => {
            DynamicImage::ImageLumaA8(ImageBuffer::from_raw(width, height, buffer).ok_or_else(mismatch)?)
        }
        png::ColorType::Rgb => {
            DynamicImage::ImageRgb8(ImageBuffer::from_raw(width, height, buffer).ok_or_else(mismatch)?)
        }
        png::ColorType::Rgba => {
            DynamicImage::ImageRgba8(ImageBuffer::from_raw(width, height, buffer).ok_or_else(mismatch)?)
        }
        png::ColorType::Indexed => return Err(mismatch()),
    };
    Ok((image, orientation))
}

/// Decodes a JPEG (8 bits a sample: grey or RGB) under the image crate's limits.
fn decode_jpeg(bytes: &[u8], checked: &Checked) -> Result<(DynamicImage, Orientation), Refusal> {
    if !jpeg_is_complete(bytes) {
        return Err(refuse(RejectionCode::Corrupt, "the JPEG is truncated (no end of image after its scan)"));
    }
    let mut reader = ImageReader::with_format(Cursor::new(bytes), ImageFormat::Jpeg);
    let mut decode_limits = image::Limits::default();
    decode_limits.max_image_width = Some(checked.width);
    decode_limits.max_image_height = Some(checked.height);
    decode_limits.max_alloc = Some(checked.memory);
    reader.limits(decode_limits);
    let refusal = |e: ImageError| match e {
        ImageError::Limits(_) => refuse(RejectionCode::TooManyPixels, format!("decoding refused: {}", short(&e))),
        other => refuse(RejectionCode::Corrupt, format!("undecodable: {}", short(&other))),
    };
    let mut decoder = reader.into_decoder().map_err(refusal)?;
    // The EXIF orientation (a camera held sideways): applied to the derivatives, since re-encoding drops the tag.
    // An unreadable EXIF block leaves the image as stored.
    let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
    let decoded = DynamicImage::from_decoder(decoder).map_err(refusal)?;
    Ok((eight_bit(decoded), orientation))
}

/// A JPEG's pixels in a layout its encoder takes: 8-bit grey or RGB (a no-op for what the decoder produces).
fn eight_bit(image: DynamicImage) -> DynamicImage {
    match image {
        DynamicImage::ImageLuma8(_) | DynamicImage::ImageRgb8(_) => image,
        other if !other.color().has_color() => DynamicImage::ImageLuma8(other.to_luma8()),
        other => DynamicImage::ImageRgb8(other.to_rgb8()),
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
    bounded(e.to_string())
}

fn bounded(mut text: String) -> String {
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
    fn a_16_bit_png_decodes_to_8_bits_in_its_own_layout() {
        let rgba16 = image::ImageBuffer::from_fn(300, 200, |x, y| {
            image::Rgba([(x * 200) as u16, (y * 300) as u16, 0x1234, if x < 150 { 0xFFFF } else { 0x8000 }])
        });
        let bytes = {
            let mut out = Vec::new();
            DynamicImage::ImageRgba16(rgba16.clone()).write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
            out
        };
        let checked = inspect("image/png", &bytes, LIMITS).unwrap();
        assert_eq!(checked.layout, "16-bit RGBA");
        let (pixels, _) = decode_png(&bytes, &checked).unwrap();
        let DynamicImage::ImageRgba8(pixels) = pixels else { panic!("not RGBA8: {:?}", pixels.color()) };
        // The high byte of each sample (what STRIP_16 keeps), never more than one step from the rounded value.
        for (x, y) in [(0, 0), (299, 199), (151, 17)] {
            let wide = rgba16.get_pixel(x, y).0;
            let narrow = pixels.get_pixel(x, y).0;
            for c in 0..4 {
                assert_eq!(narrow[c], (wide[c] >> 8) as u8, "({x}, {y}) channel {c}");
            }
        }
        let derived = derive(&bytes, checked, LIMITS).unwrap();
        assert_eq!((derived.width, derived.height), (300, 200));
        let large = image::load_from_memory(&derived.images[0].bytes).unwrap();
        assert_eq!(large.color(), image::ColorType::Rgba8, "the alpha channel is kept, at 8 bits");
    }

    #[test]
    fn the_memory_of_a_decode_is_read_from_the_header() {
        let limits = ImageLimits { max_bytes: 1 << 20, max_pixels: 64_000_000 };
        // An 8000 x 8000 16-bit RGBA header over the image data of 8 x 8: only the header counts.
        let mut bytes = {
            let small = image::ImageBuffer::from_pixel(8, 8, image::Rgba([0u16, 0, 0, 0]));
            let mut out = Vec::new();
            DynamicImage::ImageRgba16(small).write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
            out
        };
        bytes[16..20].copy_from_slice(&8000u32.to_be_bytes());
        bytes[20..24].copy_from_slice(&8000u32.to_be_bytes());
        let crc = crc32(&bytes[12..29]);
        bytes[29..33].copy_from_slice(&crc.to_be_bytes());
        let checked = inspect("image/png", &bytes, limits).unwrap();
        // 4 bytes a pixel decoded (8 bits a sample: no 16-bit buffer, no conversion copy), plus the rest.
        let pixels = 8000 * 8000 * 4;
        assert!(checked.memory >= pixels && checked.memory < pixels + 48 * (1 << 20), "{}", checked.memory);
        let refused = check_memory(&checked, 256 << 20).unwrap_err();
        assert_eq!(refused.code, RejectionCode::TooManyPixels);
        assert!(refused.detail.contains("8000x8000 16-bit RGBA needs"), "{}", refused.detail);
        assert!(check_memory(&checked, 320 << 20).is_ok());

        // A JPEG's coefficients are buffered whole when it is progressive: two bytes a sample more.
        let baseline = jpeg(400, 300);
        let checked = inspect("image/jpeg", &baseline, LIMITS).unwrap();
        assert_eq!((checked.width, checked.height, checked.layout), (400, 300, "8-bit YCbCr"));
        let mut progressive = baseline.clone();
        let sof = progressive.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        progressive[sof + 1] = 0xC2;
        let progressive = inspect("image/jpeg", &progressive, LIMITS).unwrap();
        assert_eq!(progressive.layout, "8-bit YCbCr, progressive");
        assert!(progressive.memory >= checked.memory + 400 * 300 * 2, "{progressive:?} against {checked:?}");
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        !crc
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
