//! The job's secret: where it comes from (a variable, or a per-user file made with a random
//! secret when absent, as ssh keys are kept), and the checks that keep it from being empty,
//! short, or readable by others. [`crate::config`] gives it the environment's values.

use crate::{KvError, Result};

/// The job's secret: `KVSTORE_SECRET`, else the file `KVSTORE_SECRET_FILE` names, else
/// `~/.kvstore/secret` (made with a random secret when absent). Never empty, never short,
/// never from a file others can read.
pub(crate) fn resolve(
    secret: Option<String>,
    file: Option<String>,
    home: Option<String>,
) -> Result<String> {
    let how = "set KVSTORE_SECRET (16 bytes or more, the same in every process of the job; \
               kvrun draws one), or KVSTORE_SECRET_FILE";
    let s = match (secret, file) {
        (Some(s), _) => s,
        (None, Some(f)) => read_secret_file(std::path::Path::new(&f))?,
        (None, None) => match home {
            Some(h) => secret_file(&std::path::Path::new(&h).join(".kvstore"))?,
            None => return Err(KvError::Config(format!("no job secret: {how}"))),
        },
    };
    // The environment's values are read lossily: a byte that is not UTF-8 becomes U+FFFD,
    // three bytes that every other such byte becomes too.
    if s.contains('\u{FFFD}') {
        return Err(KvError::Config(format!(
            "the job secret is not UTF-8 text, or holds U+FFFD (what a byte that is not UTF-8 \
             reads as): {how}"
        )));
    }
    if s.len() < crate::auth::MIN_SECRET {
        return Err(KvError::Config(format!(
            "the job secret has {} bytes, fewer than {}: {how}",
            s.len(),
            crate::auth::MIN_SECRET
        )));
    }
    Ok(s)
}

/// The secret in `path`, refused unless it is a regular file this user owns that no one else
/// may read, in a directory no one else may change. The file is opened once (not through a
/// symbolic link, and without blocking: a FIFO put there is refused, not waited on), and what
/// is checked is the open file that is read, so nothing can be swapped in between.
fn read_secret_file(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let bad = |why: String| KvError::Config(format!("secret file {}: {why}", path.display()));
    let me = rustix::process::geteuid().as_raw();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let d = std::fs::metadata(dir).map_err(|e| bad(format!("its directory: {e}")))?;
    if d.uid() != me && d.uid() != 0 {
        return Err(bad("in a directory of another user".into()));
    }
    // Others who may write the directory could replace the file, unless it is sticky (/tmp).
    if d.mode() & 0o022 != 0 && d.mode() & 0o1000 == 0 {
        return Err(bad(format!(
            "in a directory others may write (mode {:o}; chmod go-w)",
            d.mode() & 0o777
        )));
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => bad("a symbolic link (name the file itself)".into()),
            _ => bad(e.to_string()),
        })?;
    let m = f.metadata().map_err(|e| bad(e.to_string()))?;
    if !m.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if m.uid() != me {
        return Err(bad("owned by another user".into()));
    }
    if m.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:o}: others may read it (chmod 600)",
            m.mode() & 0o777
        )));
    }
    let mut s = String::new();
    f.take(64 * 1024)
        .read_to_string(&mut s)
        .map_err(|e| bad(e.to_string()))?;
    Ok(s.trim().to_string())
}

/// The per-user secret in `dir/secret`, made (32 random bytes, hex, mode 0600, in a 0700
/// directory) when there is none: written to a file of its own first and then linked into
/// place, so that processes starting at once all read the one that won.
fn secret_file(dir: &std::path::Path) -> Result<String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = dir.join("secret");
    if !path.exists() {
        let bad = |e: std::io::Error| {
            KvError::Config(format!(
                "cannot make the secret file {}: {e}",
                path.display()
            ))
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(bad)?;
        let tmp = dir.join(format!("secret.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(bad)?;
        let s = crate::auth::hex(&crate::auth::random::<32>().map_err(bad)?);
        f.write_all(s.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(bad)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(bad(e)),
            _ => {}
        }
    }
    read_secret_file(&path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_secret_file_is_read_only_where_no_one_else_could_have_put_it() {
        let dir = std::env::temp_dir().join(format!("kvstore-secretfile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let real = dir.join("real");
        std::fs::write(&real, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret_file(&real).unwrap(), "0123456789abcdef0123");
        let err = |p: &std::path::Path| read_secret_file(p).unwrap_err().to_string();
        // A symbolic link to a file of this user's (the link could name any 0600 file).
        let link = dir.join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(err(&link).contains("symbolic link"), "{}", err(&link));
        // A FIFO: refused at once, not waited on.
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path only.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(err(&fifo).contains("not a regular file"), "{}", err(&fifo));
        // A directory others may write: refused.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(err(&real).contains("chmod go-w"), "{}", err(&real));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
