# The two entry points of the README. Both install dependencies (Debian packages), configure,
# build and then run: `make demo` the training demo, `make test` every test.
BUILD_DIR ?= build
SANITIZE ?=
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# A build target (empty: everything); the sanitizer suites build only what they run.
TARGET ?=
# Seconds each fuzz target runs: in `make fuzz`, and in `make test` (a smoke run).
FUZZ_SECONDS ?= 60
TEST_FUZZ_SECONDS ?= 3
SOAK_SECONDS ?= 600
SOAK_PROTOCOL ?= grpc+verbs

.PHONY: all deps configure build demo test test-unit test-asan test-tsan test-python-asan fuzz soak \
	settings-table state-diagrams bench-report format clean

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORVERBS_WERROR=ON -DSANITIZE=$(SANITIZE) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) $(if $(TARGET),--target $(TARGET))

demo: build
	$(BUILD_DIR)/tools/tensorverbs demo

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --label-exclude 'hw|soak'
	$(MAKE) fuzz FUZZ_SECONDS=$(TEST_FUZZ_SECONDS)

# Minutes of churn between real processes (tests/soak/): mixed sizes, aborted steps, killed
# and restarted peers; memory and descriptors must stay flat. SOAK_PROTOCOL picks the protocol.
# The binary runs directly, bounded by its length plus ten minutes: through CTest, the test's
# TIMEOUT property (1500 s, for `ctest -L soak`) would end a longer run, since CTest's --timeout
# does not override a test's own.
soak: build
	cd $(BUILD_DIR) && TV_SOAK_SECONDS=$(SOAK_SECONDS) \
	  TV_SOAK_PROTOCOL=$(SOAK_PROTOCOL) \
	  timeout -k 30 $$(( $(SOAK_SECONDS) + 600 )) tests/soak/soak_test

# Rewrites the README's configuration tables from src/common/settings.cc (the build fails
# while they differ).
settings-table: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target tensorverbs
	cmake -DTOOL=$(BUILD_DIR)/tools/tensorverbs -DREADME=README.md -DUPDATE=ON \
	  -P cmake/CheckSettingsTable.cmake

# Redraws docs/architecture/state-machines.md from the protocol's state tables (a unit test
# fails while the page and the tables differ).
state-diagrams: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target state_diagrams

# Today's headline figures against the raw fabric, memcpy, UCX and gloo (bench/report.py): JSON,
# PNGs and headline.md under docs/perf/current/, and the same tables at the top of
# docs/PERFORMANCE.md. Run it on an idle machine (about 15 minutes).
# Debian's interpreter (DEBIAN_PYTHON, below): the one scripts/install-deps.sh gives PyTorch, for
# the figures against gloo.
bench-report: build
	$(DEBIAN_PYTHON) bench/report.py --tool $(BUILD_DIR)/tools/tensorverbs --out docs/perf/current \
	  --into docs/PERFORMANCE.md

test-unit: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) -L unit

# Sanitizer builds of the unit and conformance tests, in their own build directories.
test-asan:
	$(MAKE) build BUILD_DIR=build-asan SANITIZE=address TARGET=sanitizer_suite
	cd build-asan && ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/cmake/lsan.supp \
	  ctest --output-on-failure -j $(JOBS) -L 'unit|conformance'

test-tsan:
	$(MAKE) build BUILD_DIR=build-tsan SANITIZE=thread TARGET=sanitizer_suite
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$(CURDIR)/cmake/tsan.supp \
	  ctest --output-on-failure -j $(JOBS) -L 'unit|conformance'

# The Python package's tests (the module and the torch backend, which the sanitizer suites above
# leave out) with the modules built with ASan and UBSan in build-asan-python/ (SANITIZE=address,
# which keeps the Python package with TENSORVERBS_SANITIZED_PYTHON). Python itself is not
# instrumented, so its processes, and the rank processes the tests start, preload the ASan
# runtime, and libstdc++ beside it so that ASan finds the C++ throw it intercepts. Leak checking
# is off: the interpreter keeps its objects at exit. Not part of `make test` (about 12 minutes).
# Debian's interpreter, as the build uses (python/CMakeLists.txt): scripts/install-deps.sh gives it
# pytest, NumPy and torch, whatever python3 comes first on the PATH.
DEBIAN_PYTHON ?= /usr/bin/python3
test-python-asan: deps
	cmake -S . -B build-asan-python -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DTENSORVERBS_BUILD_TESTS=OFF -DTENSORVERBS_WERROR=ON -DSANITIZE=address \
	  -DTENSORVERBS_SANITIZED_PYTHON=ON $(CMAKE_FLAGS)
	cmake --build build-asan-python -j $(JOBS) --target _tensorverbs _tensorverbs_torch tv_python_files
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  PYTHONPATH=build-asan-python/python PYTHONDONTWRITEBYTECODE=1 \
	  $(DEBIAN_PYTHON) -m pytest -q -p no:cacheprovider --ignore=python/tests/test_pip_install.py \
	  --ignore=python/tests/test_device_tensors.py python/tests

# The libFuzzer targets (fuzz/), built with clang, ASan and UBSan in build-fuzz/, each run for
# FUZZ_SECONDS from its seed corpus (TENSORVERBS_FUZZ_CORPUS=DIR keeps what they find).
fuzz: deps
	cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTENSORVERBS_FUZZ=ON $(CMAKE_FLAGS)
	cmake --build build-fuzz -j $(JOBS) --target fuzzers
	cd build-fuzz && TENSORVERBS_FUZZ_SECONDS=$(FUZZ_SECONDS) \
	  ctest --output-on-failure -j $(JOBS) -L fuzz --timeout $$(( $(FUZZ_SECONDS) + 300 ))

format:
	find src tools tests -name '*.h' -o -name '*.cc' | xargs clang-format -i

clean:
	rm -rf build build-asan build-tsan build-fuzz build-asan-python
