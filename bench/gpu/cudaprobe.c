/* The CUDA driver probe for a container without Python: load libcuda.so.1 as a CUDA program
   would, cuInit, count the devices, read the first one's name and UUID, and say which file
   defines cuInit (dladdr). Prints one JSON object; exits 0 only when a GPU answered.
   Build: gcc -O2 -o cudaprobe cudaprobe.c (glibc >= 2.34: dlopen is in libc). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*init_fn)(unsigned);
typedef int (*int_fn)(int *);
typedef int (*get_fn)(int *, int);
typedef int (*name_fn)(char *, int, int);
typedef int (*uuid_fn)(unsigned char *, int);

int main(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (!cuda) {
    printf("{\"libcuda\": null, \"error\": \"%s\", \"devices\": 0}\n", dlerror());
    return 1;
  }
  init_fn cu_init = (init_fn)dlsym(cuda, "cuInit");
  Dl_info info = {0};
  char real[PATH_MAX] = "";
  if (cu_init && dladdr((void *)cu_init, &info) && info.dli_fname)
    if (!realpath(info.dli_fname, real)) snprintf(real, sizeof real, "%s", info.dli_fname);
  int status = cu_init ? cu_init(0) : -1, count = 0, version = 0, device = 0;
  int_fn driver_version = (int_fn)dlsym(cuda, "cuDriverGetVersion");
  if (driver_version) driver_version(&version);
  int_fn get_count = (int_fn)dlsym(cuda, "cuDeviceGetCount");
  if (status == 0 && get_count) get_count(&count);
  char name[256] = "";
  unsigned char u[16] = {0};
  if (count > 0) {
    get_fn get = (get_fn)dlsym(cuda, "cuDeviceGet");
    name_fn get_name = (name_fn)dlsym(cuda, "cuDeviceGetName");
    uuid_fn get_uuid = (uuid_fn)dlsym(cuda, "cuDeviceGetUuid_v2");
    if (!get_uuid) get_uuid = (uuid_fn)dlsym(cuda, "cuDeviceGetUuid");
    if (get && get(&device, 0) == 0) {
      if (get_name) get_name(name, sizeof name, device);
      if (get_uuid) get_uuid(u, device);
    }
  }
  printf("{\"libcuda\": \"%s\", \"init_status\": %d, \"driver_api\": %d, \"devices\": %d, "
         "\"name\": \"%s\", \"uuid\": \"GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
         "%02x%02x%02x%02x%02x%02x\"}\n", real, status, version, count, name, u[0], u[1], u[2],
         u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return (status == 0 && count > 0) ? 0 : 1;
}
