// baton's version: CMake's project version (CMakeLists.txt), compiled into version.cpp only, so a
// new version rebuilds one file. Reported in load reports and ListWorkers, shown by batonctl doctor.
#pragma once

namespace baton {

const char* baton_version();

}  // namespace baton
