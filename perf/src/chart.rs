//! Charts of kvperf's results (the plotters crate): SVG or PNG by the file's extension, sizes
//! on a log scale, axis titles, a legend, and the reference as a second line where one was
//! measured. Text needs a TrueType font: `KVPERF_FONT`, else DejaVu Sans where Linux
//! distributions put it.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

/// One line of a chart: its name and its (size, value) points.
pub type Series<'a> = (&'a str, &'a [(f64, f64)]);

const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
];

/// Registers a font for the charts' text, once.
fn font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let candidates: Vec<String> = std::env::var("KVPERF_FONT")
            .into_iter()
            .chain(FONTS.iter().map(|s| s.to_string()))
            .collect();
        let bytes = candidates
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| {
                "a chart needs a TrueType font: install fonts-dejavu-core, or set \
                 KVPERF_FONT=/path/to/font.ttf"
                    .to_string()
            })?;
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| "the font could not be read".to_string())
    })
    .clone()
}

/// Writes a chart of `series` against size to `path` (`.svg` or `.png`).
pub fn write(path: &Path, title: &str, ylabel: &str, series: &[Series<'_>]) -> Result<(), String> {
    font()?;
    let err = |e: String| format!("{}: {e}", path.display());
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => draw(
            SVGBackend::new(path, (800, 480)).into_drawing_area(),
            title,
            ylabel,
            series,
        ),
        Some("png") => draw(
            BitMapBackend::new(path, (800, 480)).into_drawing_area(),
            title,
            ylabel,
            series,
        ),
        _ => Err("a chart is written as .svg or .png".into()),
    }
    .map_err(err)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    ylabel: &str,
    series: &[Series<'_>],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let all = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, 0f64, 0f64);
    for &(x, y) in all {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x.max(1.0));
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
    }
    if !x0.is_finite() {
        return Err("no points to chart".into());
    }
    let x1 = x1.max(x0 * 2.0);
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1).log_scale(), 0f64..y1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("size, bytes (log scale)")
        .y_desc(ylabel)
        .x_label_formatter(&|v| kvstore_perf_size(*v))
        .draw()
        .map_err(|x| e(&x))?;
    let colors = [BLUE, RED, GREEN, MAGENTA];
    for (i, (name, points)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}

fn kvstore_perf_size(v: f64) -> String {
    crate::format_size(v.max(0.0).round() as usize)
}
