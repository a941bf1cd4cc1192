#include "model/file_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace baton {

Result<std::unique_ptr<FileMapping>> FileMapping::open(const std::string& path, const std::string& label) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("cannot open " + label + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(label + " is not a regular file");
  }
  auto file = std::unique_ptr<FileMapping>(new FileMapping());
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* m = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return invalid_argument("cannot map " + label + ": " + std::strerror(err));
    }
    file->mapping_ = m;
  }
  ::close(fd);
  return file;
}

FileMapping::~FileMapping() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

}  // namespace baton
